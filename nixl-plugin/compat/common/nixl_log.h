// SPDX-License-Identifier: Apache-2.0
// OrbiTE's stand-in for NIXL's common/nixl_log.h in standalone builds of
// the plugin. NIXL's own header needs Abseil's logging headers; these
// macros keep the same names and stream syntax over std::cerr, so the
// plugin needs no NIXL or Abseil library at link time. Inside NIXL's tree
// the real header is used instead (this directory is not on the path).
#ifndef ORBITE_COMPAT_NIXL_LOG_H
#define ORBITE_COMPAT_NIXL_LOG_H

#include <cassert>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>

namespace orbite_compat_log {

// 0 trace, 1 debug, 2 info, 3 warn, 4 error, 5 fatal; NIXL_LOG_LEVEL
// (TRACE, DEBUG, INFO, WARN, ERROR, FATAL) picks the threshold, WARN by
// default.
inline int threshold() {
    static const int level = [] {
        const char *e = std::getenv("NIXL_LOG_LEVEL");
        if (e == nullptr) return 3;
        const char *names[] = {"TRACE", "DEBUG", "INFO", "WARN", "ERROR", "FATAL"};
        for (int i = 0; i < 6; ++i) {
            if (std::strcmp(e, names[i]) == 0) return i;
        }
        return 3;
    }();
    return level;
}

class Line {
public:
    Line(const char *tag, int level) : tag_(tag), on_(level >= threshold()) {}
    Line(const Line &) = delete;
    Line &operator=(const Line &) = delete;
    ~Line() {
        if (on_) std::cerr << "[nixl " << tag_ << "] " << out_.str() << std::endl;
    }
    template <class T> Line &operator<<(const T &value) {
        if (on_) out_ << value;
        return *this;
    }

private:
    const char *tag_;
    bool on_;
    std::ostringstream out_;
};

} // namespace orbite_compat_log

#define NIXL_FATAL ::orbite_compat_log::Line("FATAL", 5)
#define NIXL_ERROR ::orbite_compat_log::Line("ERROR", 4)
#define NIXL_ERROR_FUNC NIXL_ERROR << __FUNCTION__ << ": "
#define NIXL_WARN ::orbite_compat_log::Line("WARN", 3)
#define NIXL_INFO ::orbite_compat_log::Line("INFO", 2)
#define NIXL_DEBUG ::orbite_compat_log::Line("DEBUG", 1)
#define NIXL_TRACE ::orbite_compat_log::Line("TRACE", 0)
#define NIXL_ASSERT_ALWAYS(condition) ((condition) ? (void)0 : std::abort())
#define NIXL_ASSERT(condition) assert(condition)

#endif
