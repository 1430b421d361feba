// The nesting and key lengths of a TOML text, checked before toml++ reads it.
// toml++ builds and destroys its tables recursively, so a dotted key or a
// table header 100,000 parts deep overflows the stack, even when the parse
// fails; and a key of megabytes makes every message about it (the closest
// valid key is an edit distance) take seconds. Only the structure is read
// here: strings and comments are skipped, so a dot or a bracket inside them
// counts for nothing, and what is not valid TOML is left for toml++ to name,
// except non-ASCII characters outside strings and comments: toml++ 3.3 tests
// whether they are whitespace with a function that reaches
// __builtin_unreachable for most of them (U+00A1 to U+0499, ...).
#include <fmt/format.h>

#include <vector>

#include "config/schema.hpp"
#include "errors.hpp"

namespace meshrun::config_detail {
namespace {

class ShapeScanner {
 public:
  ShapeScanner(std::string_view text, const std::string& source) : text_(text), source_(source) {}

  void run() {
    while (at_ < text_.size()) step();
  }

 private:
  // An open array or inline table: the depth of its node.
  struct Open {
    int depth;
    bool table;
  };

  char peek(size_t ahead = 0) const {
    return at_ + ahead < text_.size() ? text_[at_ + ahead] : '\0';
  }

  void advance() {
    const auto byte = static_cast<unsigned char>(text_[at_++]);
    if (byte == '\n') {
      ++line_;
      column_ = 1;
    } else if ((byte & 0xC0) != 0x80) {  // UTF-8 continuation bytes share a column
      ++column_;
    }
  }

  void step() {
    const char c = peek();
    if (c == '#') return skip_comment();
    if ((c == '"' || c == '\'') && starts_token()) return skip_string(c);
    if (c == '\n') {
      advance();
      if (open_.empty()) start_statement();
      return;
    }
    refuse_non_ascii(c);
    if (key_mode_) return key_char(c);
    value_char(c);
  }

  // A quote opens a string, and a bracket or brace an array or inline
  // table, only where TOML can start one: first on a line or after a blank,
  // or right after the separator that ends what came before (the '=' that
  // ends a key, an opening bracket or brace, an array's comma, a dot between
  // the parts of a key: a."b"). Glued to a bare word or number (181"abc,
  // 4."abc: in a value the dot is the number's; 1'='x, 0=<["x) toml++ reads
  // it as more of that token, non-ASCII characters after it included.
  bool starts_token() const {
    if (at_ == 0) return true;
    const char before = text_[at_ - 1];
    if (before == ' ' || before == '\t' || before == '\r' || before == '\n') return true;
    return at_ - 1 == separator_at_;
  }

  void refuse_non_ascii(char c) const {
    if (static_cast<unsigned char>(c) < 0x80) return;
    fail("a non-ASCII character outside a string or a comment, where TOML allows none");
  }

  void start_statement() {
    key_mode_ = true;
    depth_ = table_depth_ + 1;
    key_bytes_ = 0;
    statement_start_ = at_;
  }

  void key_char(char c) {
    if (c == '[' && open_.empty() && at_ == first_non_blank()) return read_header();
    if (c == '.') {
      key_bytes_ = 0;
      separator_at_ = at_;
      nest_deeper(depth_ + 1);
    } else if (c == '=') {
      key_mode_ = false;
      separator_at_ = at_;
    } else if (c == '}') {
      close();
      return;
    } else if (c != ' ' && c != '\t' && c != '\r') {
      count_key_byte();
    }
    advance();
  }

  void value_char(char c) {
    if ((c == '[' || c == '{') && starts_token()) {
      separator_at_ = at_;
      open_.push_back({depth_, c == '{'});
      key_mode_ = c == '{';
      key_bytes_ = 0;
      nest_deeper(depth_ + 1);
    } else if (c == ']' || c == '}') {
      close();
      return;
    } else if (c == ',' && !open_.empty()) {
      separator_at_ = at_;
      depth_ = open_.back().depth + 1;
      key_mode_ = open_.back().table;
      key_bytes_ = 0;
    }
    advance();
  }

  void close() {
    if (!open_.empty()) {
      depth_ = open_.back().depth;
      open_.pop_back();
    }
    key_mode_ = false;
    advance();
  }

  // [a.b] or [[a.b]]. Each part counts two levels: it may name an array of
  // tables, whose element is one level below the array.
  void read_header() {
    depth_ = 0;
    key_bytes_ = 0;
    while (at_ < text_.size() && peek() != '\n' && peek() != '#') {
      const char c = peek();
      if ((c == '"' || c == '\'') && starts_token()) {
        skip_string(c);
        continue;
      }
      if (c == ']') break;
      refuse_non_ascii(c);
      if (c == '[' || c == '.') {
        key_bytes_ = 0;
        separator_at_ = at_;
        nest_deeper(depth_ + 2);
      } else if (c != ' ' && c != '\t') {
        count_key_byte();
      }
      advance();
    }
    table_depth_ = depth_;
    key_mode_ = false;  // the rest of the line is "]" or "]]"
  }

  size_t first_non_blank() const {
    size_t position = statement_start_;
    while (position < text_.size() && (text_[position] == ' ' || text_[position] == '\t')) {
      ++position;
    }
    return position;
  }

  void skip_comment() {
    while (at_ < text_.size() && peek() != '\n') advance();
  }

  // A basic ("...", with escapes) or literal ('...') string, single- or
  // multi-line; its bytes count toward the key when it is a quoted key.
  void skip_string(char quote) {
    const bool multiline = peek(1) == quote && peek(2) == quote;
    const size_t quotes = multiline ? 3 : 1;
    for (size_t i = 0; i < quotes; ++i) advance();
    while (at_ < text_.size()) {
      const char c = peek();
      if (c == '\\' && quote == '"') {
        if (multiline) check_after_backslash();
        advance();
        if (at_ < text_.size()) advance();
        continue;
      }
      if (c == quote && (!multiline || (peek(1) == quote && peek(2) == quote))) {
        for (size_t i = 0; i < quotes; ++i) advance();
        // """a"""" is the string a": up to two more quotes belong to it.
        while (multiline && peek() == quote) advance();
        return;
      }
      if (c == '\n' && !multiline) return;
      if (key_mode_) count_key_byte();
      advance();
    }
  }

  // In a multi-line basic string toml++ tests the character after a
  // backslash with its whitespace function and, when it is blank (a line
  // ending, or blanks before one), every blank or line break after it up
  // to the first that is not: each character tested must be ASCII.
  void check_after_backslash() const {
    const auto non_ascii = [&](size_t at) {
      return at < text_.size() && static_cast<unsigned char>(text_[at]) >= 0x80;
    };
    size_t at = at_ + 1;
    if (non_ascii(at)) {
      fail(
          "a non-ASCII character after a backslash in a multi-line string; toml++ cannot "
          "read it");
    }
    const size_t first = at;
    while (at < text_.size() &&
           std::string_view(" \t\r\n").find(text_[at]) != std::string_view::npos) {
      ++at;
    }
    if (at > first && non_ascii(at)) {
      fail("a non-ASCII character first after a line-ending backslash; toml++ cannot read it");
    }
  }

  void count_key_byte() {
    if (++key_bytes_ <= kMaxKeyBytes) return;
    fail(
        fmt::format("a key longer than {} bytes ({}...); keys are names such as "
                    "num_hidden_layers",
                    kMaxKeyBytes, quoted(text_.substr(at_ + 1 - key_bytes_, 20))));
  }

  void nest_deeper(int depth) {
    depth_ = depth;
    if (depth_ <= kMaxNesting) return;
    fail(
        fmt::format("{}: nested more than {} levels deep (tables, dotted keys, arrays and inline "
                    "tables together); a meshrun config nests 3 deep",
                    quoted(text_.substr(statement_start_, at_ - statement_start_)), kMaxNesting));
  }

  [[noreturn]] void fail(const std::string& what) const {
    const SourcePosition position{source_, line_, column_};
    throw Error(MESHRUN_INVALID_ARGUMENT, one_line(position.str() + ": " + what));
  }

  std::string_view text_;
  const std::string& source_;
  size_t at_ = 0;
  int64_t line_ = 1, column_ = 1;
  size_t statement_start_ = 0;
  size_t separator_at_ = std::string_view::npos;  // the last separator read (starts_token)
  bool key_mode_ = true;
  int table_depth_ = 0;   // of the last [table] header
  int depth_ = 1;         // of the node being read
  size_t key_bytes_ = 0;  // of the key part being read
  std::vector<Open> open_;
};

}  // namespace

void check_toml_shape(std::string_view text, const std::string& source) {
  ShapeScanner(text, source).run();
}

}  // namespace meshrun::config_detail
