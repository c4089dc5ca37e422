//! The module graph of orbite-core has no import circle, and its top-level
//! modules depend only on modules listed above them in the layer table of
//! docs/architecture.md.
//!
//! The graph is read from the sources: every `crate::`/`super::`/`self::`
//! path and every `use` tree, resolved to the module that defines the item
//! (following `pub use` re-exports, so reaching a module through the crate
//! root's re-exports still counts as depending on it). Test modules
//! (`#[cfg(test)]`) are left out. A module and its own ancestors may name
//! each other (a parent declares and re-exports its children); between
//! siblings, at every level, the dependencies must form no circle.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

type ModPath = Vec<String>;

struct Module {
    file: PathBuf,
    /// Source with comments, strings and test modules removed.
    code: String,
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Blank out comments, string and char literals (keeping line structure).
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == b'r' && matches!(b.get(i + 1), Some(b'"') | Some(b'#')) && !prev_ident(b, i) {
            // Raw string r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c as char);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"' && (0..hashes).all(|h| b.get(j + 1 + h) == Some(&b'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\'' {
            // A char literal ('x', '\n', '{') or a lifetime ('a).
            if b.get(i + 1) == Some(&b'\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != b'\'' {
                    j += 1;
                }
                out.push_str("' '");
                i = j + 1;
            } else if b.get(i + 2) == Some(&b'\'') {
                out.push_str("' '");
                i += 3;
            } else {
                out.push('\'');
                i += 1;
            }
        } else {
            out.push(c as char);
            i += 1;
        }
    }
    out
}

fn prev_ident(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// Remove `#[cfg(test)]` items: inline `mod x { .. }` blocks and `mod x;`
/// declarations (returned, so that their files are skipped).
fn drop_test_items(code: &str, skipped: &mut Vec<String>) -> String {
    let mut out = code.to_owned();
    while let Some(at) = out.find("#[cfg(test)]") {
        let rest = &out[at + "#[cfg(test)]".len()..];
        let trimmed = rest.trim_start();
        let lead = rest.len() - trimmed.len();
        let start = at;
        let body = at + "#[cfg(test)]".len() + lead;
        let end = if let Some(decl) = trimmed.strip_prefix("mod ") {
            let name: String = decl.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            let after = decl[name.len()..].trim_start();
            if after.starts_with(';') {
                skipped.push(name);
                body + trimmed.find(';').unwrap() + 1
            } else {
                block_end(&out, body)
            }
        } else {
            // Any other test-only item: drop up to its end (`;` or block).
            let semi = trimmed.find(';').map(|s| body + s + 1);
            let brace = trimmed.find('{').map(|_| block_end(&out, body));
            match (semi, brace) {
                (Some(s), Some(b)) => s.min(b),
                (Some(s), None) => s,
                (None, Some(b)) => b,
                (None, None) => out.len(),
            }
        };
        out.replace_range(start..end, "");
    }
    out
}

/// The index after the block whose `{` is the first at or after `from`.
fn block_end(s: &str, from: usize) -> usize {
    let b = s.as_bytes();
    let mut i = from + s[from..].find('{').expect("a block");
    let mut depth = 0;
    while i < b.len() {
        match b[i] {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    b.len()
}

fn load() -> BTreeMap<ModPath, Module> {
    let mut modules = BTreeMap::new();
    let root = src_dir();
    let mut skipped_files: BTreeSet<PathBuf> = BTreeSet::new();
    let mut files = Vec::new();
    collect(&root, &mut files);
    files.sort();
    // Declarations first, so that test-only files can be skipped.
    let mut parsed = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&root).unwrap().to_path_buf();
        if rel.starts_with("bin") {
            continue;
        }
        let mut path: ModPath = rel.iter().map(|c| c.to_string_lossy().trim_end_matches(".rs").to_owned()).collect();
        if matches!(path.last().map(String::as_str), Some("mod") | Some("lib")) {
            path.pop();
        }
        let src = std::fs::read_to_string(&file).unwrap();
        let mut skipped = Vec::new();
        let code = drop_test_items(&strip(&src), &mut skipped);
        let dir = if rel.file_name().is_some_and(|n| n == "mod.rs" || n == "lib.rs") {
            file.parent().unwrap().to_path_buf()
        } else {
            file.with_extension("")
        };
        for name in skipped {
            skipped_files.insert(dir.join(format!("{name}.rs")));
            skipped_files.insert(dir.join(&name).join("mod.rs"));
        }
        parsed.push((file, path, code));
    }
    for (file, path, code) in parsed {
        if skipped_files.iter().any(|s| file.starts_with(s.with_extension("")) || &file == s) {
            continue;
        }
        modules.insert(path, Module { file, code });
    }
    modules
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            collect(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Paths named by `use` trees (expanded) and by inline paths.
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    // `use` statements, expanded.
    let mut rest = code;
    while let Some(at) = find_word(rest, "use") {
        let tail = &rest[at + 3..];
        let end = tail.find(';').unwrap_or(tail.len());
        expand(&normalize(&tail[..end]), Vec::new(), &mut out);
        rest = &tail[end..];
    }
    // Inline paths starting with crate::, super:: or self::.
    let b = code.as_bytes();
    for start in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(start) {
            let at = from + i;
            from = at + start.len();
            if prev_ident(b, at) || (at >= 2 && &code[at - 2..at] == "::") {
                continue;
            }
            let mut segs = vec![start.trim_end_matches("::").to_owned()];
            let mut j = from;
            loop {
                let name: String = code[j..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if name.is_empty() {
                    break;
                }
                j += name.len();
                segs.push(name);
                if code[j..].starts_with("::") {
                    j += 2;
                } else {
                    break;
                }
            }
            out.push(segs);
        }
    }
    out
}

fn find_word(s: &str, w: &str) -> Option<usize> {
    let b = s.as_bytes();
    let mut from = 0;
    while let Some(i) = s[from..].find(w) {
        let at = from + i;
        let after = b.get(at + w.len()).copied();
        if !prev_ident(b, at) && matches!(after, Some(b' ') | Some(b'\n') | Some(b'\t')) {
            return Some(at);
        }
        from = at + w.len();
    }
    None
}

/// Whitespace runs as one space, none around `::`, `{`, `}` and `,`.
fn normalize(s: &str) -> String {
    let words: Vec<&str> = s.split_whitespace().collect();
    let mut out = words.join(" ");
    for t in ["::", "{", "}", ","] {
        out = out.replace(&format!(" {t}"), t).replace(&format!("{t} "), t);
    }
    out
}

/// Expand a use tree (`a::b::{c, d::{e, f}}`) into paths.
fn expand(tree: &str, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    if let Some(open) = tree.find('{') {
        let head = &tree[..open];
        let mut base = prefix.clone();
        base.extend(head.split("::").map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned));
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&inner[start..i], base.clone(), out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        expand(&inner[start..], base, out);
    } else {
        let tree = tree.split(" as ").next().unwrap_or(tree);
        let mut p = prefix;
        p.extend(tree.split("::").map(str::trim).filter(|s| !s.is_empty() && *s != "*").map(str::to_owned));
        if !p.is_empty() {
            out.push(p);
        }
    }
}

struct Graph {
    modules: BTreeMap<ModPath, Module>,
    /// Per module: name re-exported with `pub use` -> full path it names.
    reexports: HashMap<ModPath, HashMap<String, Vec<String>>>,
}

impl Graph {
    fn new() -> Graph {
        let modules = load();
        let mut reexports = HashMap::new();
        for (path, m) in &modules {
            let mut names = HashMap::new();
            for stmt in m.code.split(';') {
                let t = stmt.trim_start();
                let Some(tree) = t.strip_prefix("pub use ").or_else(|| t.strip_prefix("pub(crate) use ")) else {
                    continue;
                };
                let tree = normalize(tree);
                let mut expanded = Vec::new();
                expand(&tree, Vec::new(), &mut expanded);
                for p in expanded {
                    if let Some(last) = p.last() {
                        names.insert(last.clone(), absolute(path, &p));
                    }
                }
            }
            reexports.insert(path.clone(), names);
        }
        Graph { modules, reexports }
    }

    /// The module that defines what `path` (absolute) names.
    fn resolve(&self, path: &[String], depth: usize) -> Option<ModPath> {
        let mut m: ModPath = Vec::new();
        let mut i = 0;
        while i < path.len() {
            let mut next = m.clone();
            next.push(path[i].clone());
            if self.modules.contains_key(&next) {
                m = next;
                i += 1;
            } else {
                break;
            }
        }
        if i < path.len() && depth < 8 {
            if let Some(target) = self.reexports.get(&m).and_then(|r| r.get(&path[i])) {
                let mut full = target.clone();
                full.extend(path[i + 1..].iter().cloned());
                if full != path {
                    return self.resolve(&full, depth + 1);
                }
            }
        }
        Some(m)
    }

    /// Edges module -> module, with one witness each.
    fn edges(&self) -> BTreeMap<(ModPath, ModPath), String> {
        let mut edges = BTreeMap::new();
        for (path, m) in &self.modules {
            for p in paths(&m.code) {
                let first = p[0].as_str();
                if !matches!(first, "crate" | "super" | "self") && !self.is_child(path, first) {
                    continue;
                }
                let abs = absolute(path, &p);
                if let Some(to) = self.resolve(&abs, 0) {
                    if &to != path {
                        edges
                            .entry((path.clone(), to))
                            .or_insert_with(|| format!("{}: {}", rel(&m.file), p.join("::")));
                    }
                }
            }
        }
        edges
    }

    fn is_child(&self, path: &ModPath, name: &str) -> bool {
        let mut c = path.clone();
        c.push(name.to_owned());
        self.modules.contains_key(&c)
    }
}

fn rel(p: &Path) -> String {
    p.strip_prefix(src_dir()).unwrap_or(p).display().to_string()
}

/// Make a path absolute (from the crate root), as seen from module `at`.
fn absolute(at: &ModPath, p: &[String]) -> Vec<String> {
    let mut base = at.clone();
    let mut i = 0;
    match p.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            i = 1;
        }
        Some("self") => i = 1,
        Some("super") => {
            while p.get(i).map(String::as_str) == Some("super") {
                base.pop();
                i += 1;
            }
        }
        _ => {}
    }
    base.extend(p[i..].iter().cloned());
    base
}

/// Sibling dependencies under each parent: parent -> (child -> children it uses).
type Levels = BTreeMap<ModPath, BTreeMap<String, BTreeMap<String, String>>>;

fn levels(edges: &BTreeMap<(ModPath, ModPath), String>) -> Levels {
    let mut levels: Levels = BTreeMap::new();
    for ((from, to), witness) in edges {
        let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
        if common == from.len() || common == to.len() {
            continue; // a module and its ancestor
        }
        let parent = from[..common].to_vec();
        levels
            .entry(parent)
            .or_default()
            .entry(from[common].clone())
            .or_default()
            .entry(to[common].clone())
            .or_insert_with(|| witness.clone());
    }
    levels
}

fn find_cycle(deps: &BTreeMap<String, BTreeMap<String, String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        deps: &BTreeMap<String, BTreeMap<String, String>>,
        state: &mut HashMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_owned(), 1);
        stack.push(n.to_owned());
        for m in deps.get(n).into_iter().flat_map(|d| d.keys()) {
            match state.get(m.as_str()).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|s| s == m).unwrap();
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(m, deps, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_owned(), 2);
        None
    }
    let mut state = HashMap::new();
    for n in deps.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            let mut stack = Vec::new();
            if let Some(c) = visit(n, deps, &mut state, &mut stack) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn no_import_circle_among_modules() {
    let g = Graph::new();
    assert!(g.modules.len() > 20, "found the sources ({} modules)", g.modules.len());
    let levels = levels(&g.edges());
    let mut failures = Vec::new();
    for (parent, deps) in &levels {
        if let Some(cycle) = find_cycle(deps) {
            let shown = if parent.is_empty() { "crate".to_owned() } else { parent.join("::") };
            let mut msg = format!("import circle under `{shown}`: {}", cycle.join(" -> "));
            for w in cycle.windows(2) {
                msg.push_str(&format!("\n    {} -> {}: {}", w[0], w[1], deps[&w[0]][&w[1]]));
            }
            failures.push(msg);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The modules of the layer table, in the order of its rows.
fn layer_table() -> Vec<String> {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/architecture.md")).unwrap();
    let section = doc.split("## Layers").nth(1).expect("docs/architecture.md has a Layers section");
    let mut rows = Vec::new();
    for line in section.lines().skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|')) {
        let cell = line.trim_start_matches('|').split('|').next().unwrap_or("").trim();
        if let Some(name) = cell.strip_prefix('`').and_then(|c| c.split('`').next()) {
            rows.push(name.to_owned());
        }
    }
    rows
}

#[test]
fn dependencies_point_down_the_layer_table() {
    let g = Graph::new();
    let table = layer_table();
    let rank: HashMap<&str, usize> = table.iter().enumerate().map(|(i, m)| (m.as_str(), i)).collect();
    let top: BTreeSet<&str> = g.modules.keys().filter(|p| p.len() == 1).map(|p| p[0].as_str()).collect();
    let missing: Vec<&&str> = top.iter().filter(|m| !rank.contains_key(**m)).collect();
    assert!(missing.is_empty(), "modules missing from the layer table of docs/architecture.md: {missing:?}");
    let mut wrong = Vec::new();
    let levels = levels(&g.edges());
    if let Some(deps) = levels.get(&Vec::new()) {
        for (from, tos) in deps {
            for (to, witness) in tos {
                if rank[from.as_str()] <= rank[to.as_str()] {
                    wrong.push(format!("`{from}` uses `{to}`, listed below it ({witness})"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "each module may use only modules listed above it:\n{}", wrong.join("\n"));
}

/// `cargo test --test module_layers -- --ignored --nocapture` prints the
/// graph, level by level.
#[test]
#[ignore]
fn print_module_graph() {
    for (parent, deps) in levels(&Graph::new().edges()) {
        println!("under `{}`:", if parent.is_empty() { "crate".to_owned() } else { parent.join("::") });
        for (from, tos) in deps {
            println!("  {from} -> {}", tos.keys().cloned().collect::<Vec<_>>().join(", "));
        }
    }
}

#[test]
fn the_checker_finds_circles_and_reads_use_trees() {
    let mut deps: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    deps.entry("a".into()).or_default().insert("b".into(), String::new());
    deps.entry("b".into()).or_default().insert("c".into(), String::new());
    assert_eq!(find_cycle(&deps), None);
    deps.entry("c".into()).or_default().insert("a".into(), String::new());
    assert_eq!(find_cycle(&deps), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
    let mut out = Vec::new();
    expand(&normalize("crate::x::{y, z::{Alias as B, w}, self}"), Vec::new(), &mut out);
    assert_eq!(
        out,
        [
            vec!["crate", "x", "y"],
            vec!["crate", "x", "z", "Alias"],
            vec!["crate", "x", "z", "w"],
            vec!["crate", "x", "self"]
        ]
    );
}
