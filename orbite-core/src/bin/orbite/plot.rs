//! `orbite bench --plot FILE.svg`: W1 throughput (GB/s) against block size
//! per route and direction, with each row's in-run limit (the machine's
//! reference for that route) drawn dashed. A small SVG writer of our own:
//! no font or drawing library, so it runs anywhere the bench runs.

use std::fmt::Write as _;

use serde_json::{Map, Value};

const W: f64 = 900.0;
const H: f64 = 560.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 230.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"];

/// One line: its label, points (block bytes, GB/s), and whether it is a
/// limit (dashed).
struct Line {
    label: String,
    points: Vec<(f64, f64)>,
    limit: bool,
}

/// The W1 lines of `rows`, and each route and direction's limit.
fn lines(rows: &[Map<String, Value>]) -> Vec<Line> {
    let mut out: Vec<Line> = Vec::new();
    let mut add = |label: String, x: f64, y: f64, limit: bool| match out.iter_mut().find(|l| l.label == label) {
        Some(l) => l.points.push((x, y)),
        None => out.push(Line { label, points: vec![(x, y)], limit }),
    };
    for r in rows {
        let s = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("");
        let f = |k: &str| r.get(k).and_then(Value::as_f64);
        if s("system") != "orbite" || !s("workload").starts_with("W1-") {
            continue;
        }
        let (Some(x), Some(y)) = (f("block_bytes"), f("gbps")) else { continue };
        let what = format!("{} {}", s("route"), s("workload"));
        add(what.clone(), x, y, false);
        if let Some(limit) = f("limit_gbps") {
            add(format!("{what} limit ({})", s("limit")), x, limit, true);
        }
    }
    for l in &mut out {
        l.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn size(bytes: f64) -> String {
    match bytes {
        b if b >= 1048576.0 => format!("{} MiB", b / 1048576.0),
        b if b >= 1024.0 => format!("{} KiB", b / 1024.0),
        b => format!("{b} B"),
    }
}

/// The SVG of `rows`' W1 measurements (`title` on top), or `None` when
/// there is none.
pub fn svg(rows: &[Map<String, Value>], title: &str) -> Option<String> {
    let lines = lines(rows);
    let xs: Vec<f64> = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0)).collect();
    let ys: Vec<f64> = lines.iter().flat_map(|l| l.points.iter().map(|p| p.1)).collect();
    let (x0, x1) = (xs.iter().copied().fold(f64::INFINITY, f64::min), xs.iter().copied().fold(0.0, f64::max));
    if xs.is_empty() || !x0.is_finite() || x0 <= 0.0 {
        return None;
    }
    let ymax = ys.iter().copied().fold(0.0, f64::max).max(0.001) * 1.1;
    let (lx0, lx1) = (x0.log2(), x1.log2().max(x0.log2() + 1.0));
    let px = |x: f64| LEFT + (x.log2() - lx0) / (lx1 - lx0) * (W - LEFT - RIGHT);
    let py = |y: f64| H - BOTTOM - y / ymax * (H - TOP - BOTTOM);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(s, r#"<text x="{}" y="24" font-size="16" text-anchor="middle">{}</text>"#, W / 2.0, escape(title));
    // Axes, ticks and grid.
    let (bx, by) = (H - BOTTOM, W - RIGHT);
    let _ = writeln!(s, r##"<line x1="{LEFT}" y1="{bx}" x2="{by}" y2="{bx}" stroke="#333"/>"##);
    let _ = writeln!(s, r##"<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bx}" stroke="#333"/>"##);
    let mut e = lx0.floor() as i32;
    while f64::from(e) <= lx1 {
        let x = 2f64.powi(e);
        if x >= x0 / 1.01 && x <= x1 * 1.01 {
            let p = px(x);
            let _ = writeln!(s, r##"<line x1="{p:.1}" y1="{TOP}" x2="{p:.1}" y2="{bx}" stroke="#eee"/>"##);
            let _ = writeln!(s, r#"<text x="{p:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, bx + 18.0, size(x));
        }
        e += 2;
    }
    for i in 0..=5 {
        let y = ymax * f64::from(i) / 5.0;
        let p = py(y);
        let _ = writeln!(s, r##"<line x1="{LEFT}" y1="{p:.1}" x2="{by}" y2="{p:.1}" stroke="#eee"/>"##);
        let _ = writeln!(s, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{y:.2}</text>"#, LEFT - 6.0, p + 4.0);
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">block size (bytes per descriptor)</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        H - 18.0
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">GB/s</text>"#,
        (TOP + bx) / 2.0,
        (TOP + bx) / 2.0
    );
    // One color per measured line; its limit in the same color, dashed.
    let mut color_of: Vec<(String, &str)> = Vec::new();
    for (i, l) in lines.iter().filter(|l| !l.limit).enumerate() {
        color_of.push((l.label.clone(), COLORS[i % COLORS.len()]));
    }
    for (i, l) in lines.iter().enumerate() {
        let color = color_of.iter().find(|(n, _)| l.label.starts_with(n.as_str())).map_or("#555", |c| c.1);
        let pts: Vec<String> = l.points.iter().map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y))).collect();
        let dash = if l.limit { r#" stroke-dasharray="6 4""# } else { "" };
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
            pts.join(" ")
        );
        if !l.limit {
            for (x, y) in &l.points {
                let _ = writeln!(s, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#, px(*x), py(*y));
            }
        }
        let ly = TOP + 16.0 * i as f64;
        let lx = W - RIGHT + 12.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"{dash}/>"#,
            lx + 22.0
        );
        let _ = writeln!(s, r#"<text x="{:.1}" y="{:.1}">{}</text>"#, lx + 28.0, ly + 4.0, escape(&l.label));
    }
    s.push_str("</svg>\n");
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn w1_rows_become_lines_with_their_limits() {
        let row = |w: &str, block: u64, gbps: f64| {
            serde_json::json!({"system": "orbite", "route": "local", "workload": w, "block_bytes": block,
                "gbps": gbps, "limit": "memcpy-mt", "limit_gbps": 10.0})
            .as_object()
            .unwrap()
            .clone()
        };
        let rows = vec![row("W1-write", 65536, 3.0), row("W1-write", 4096, 1.0), row("W2-write", 4096, 0.1)];
        let l = lines(&rows);
        assert_eq!(l.len(), 2, "the W1 line and its limit");
        assert_eq!(l[0].points, [(4096.0, 1.0), (65536.0, 3.0)], "sorted by block size");
        assert!(l[1].limit && l[1].label.contains("memcpy-mt"));
        let s = svg(&rows, "a <title>").unwrap();
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("a &lt;title&gt;") && s.contains("stroke-dasharray"));
        assert!(svg(&[], "none").is_none());
    }
}
