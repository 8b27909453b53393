//! Outside text (merod's and MDMA's words: error bodies, reasons, addresses) goes into log
//! lines; a newline or another control character in it must not start a line of its own
//! or rewrite the terminal. Every control character (C0, DEL, C1) and the Unicode line and
//! paragraph separators are written as escapes: `\n`, `\r`, `\t`, and `\u{XX}` for the
//! others. Text logs escape each line but its final newline, journal fields their whole
//! value; JSON logs are escaped by JSON itself.

use std::fmt::Write;

/// Appends `text` to `out` with its control characters escaped.
pub(crate) fn escape_into(text: &str, out: &mut String) {
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() || c == '\u{2028}' || c == '\u{2029}' => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
}

/// `text` with its control characters escaped.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    escape_into(text, &mut out);
    out
}

/// One formatted text log line: every control character escaped but the final newline,
/// so the line stays one line whatever text it holds. Bytes that are not UTF-8 (never
/// from the formatter) are replaced.
pub(crate) fn escape_line(line: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(line);
    let (body, newline) = match text.strip_suffix('\n') {
        Some(body) => (body, true),
        None => (&*text, false),
    };
    if !body
        .chars()
        .any(|c| c.is_control() || c == '\u{2028}' || c == '\u{2029}')
    {
        return line.to_vec();
    }
    let mut out = String::with_capacity(line.len() + 16);
    escape_into(body, &mut out);
    if newline {
        out.push('\n');
    }
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_nothing_else() {
        assert_eq!(
            escape("reason: bad\n2026-01-01T00:00:00Z  INFO forged\r\x1b[2J\u{85}\u{2028}\tend"),
            "reason: bad\\n2026-01-01T00:00:00Z  INFO forged\\r\\u{1b}[2J\\u{85}\\u{2028}\\tend"
        );
        assert_eq!(escape("plain ünïcode \\n text"), "plain ünïcode \\n text");
    }

    #[test]
    fn a_text_line_keeps_only_its_final_newline() {
        assert_eq!(
            escape_line(b"WARN join failed: no\nINFO confirmed to MDMA\n"),
            b"WARN join failed: no\\nINFO confirmed to MDMA\n".to_vec()
        );
        assert_eq!(escape_line(b"a clean line\n"), b"a clean line\n".to_vec());
        assert_eq!(escape_line(b"no newline\x07"), b"no newline\\u{7}".to_vec());
    }
}
