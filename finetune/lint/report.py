"""Lint reporters: text for people, json for tools, github for Actions annotations."""

from __future__ import annotations

import json

from finetune.lint import Finding, LintResult

FORMATS = ("text", "json", "github")


def render(result: LintResult, fmt: str = "text") -> str:
    if fmt == "json":
        return _json(result)
    if fmt == "github":
        return _github(result)
    return _text(result)


def _text_line(f: Finding) -> str:
    key = f" `{f.key}`" if f.key else ""
    fix = f"\n    fix: {f.fix}" if f.fix else ""
    return f"{f.path}:{f.line}:{f.col}: {f.severity} {f.rule}{key}: {f.message}{fix}"


def _summary(result: LintResult) -> str:
    from finetune.lint.files import skipped_text

    files_with = len({f.path for f in result.findings if f.severity != "info"})
    n_files = len(result.files)
    skipped = skipped_text(result.skipped)
    return (f"{n_files} file{'s' if n_files != 1 else ''} checked, {files_with} with problems: "
            f"{len(result.errors)} error{'s' if len(result.errors) != 1 else ''}, "
            f"{len(result.warnings)} warning{'s' if len(result.warnings) != 1 else ''}"
            + (f"; {skipped}" if skipped else ""))


def _text(result: LintResult) -> str:
    lines = [_text_line(f) for f in result.findings]
    lines.append(_summary(result))
    return "\n".join(lines) + "\n"


def _json(result: LintResult) -> str:
    payload = {
        "files": result.files,
        "findings": [f.to_dict() for f in result.findings],
        "errors": len(result.errors),
        "warnings": len(result.warnings),
        "skipped": {several: n for (_, several), n in result.skipped.items()},
    }
    return json.dumps(payload, indent=2) + "\n"


def _escape_data(text: str) -> str:
    # GitHub workflow command escaping: https://github.com/actions/toolkit (core/src/command.ts)
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def _github(result: LintResult) -> str:
    level = {"error": "error", "warning": "warning", "info": "notice"}
    lines = []
    for f in result.findings:
        message = f.message + (f" (fix: {f.fix})" if f.fix else "")
        if f.key:
            message = f"`{f.key}`: {message}"
        props = f"file={_escape_property(f.path)},line={f.line},col={f.col},title={_escape_property(f.rule)}"
        lines.append(f"::{level.get(f.severity, 'notice')} {props}::{_escape_data(message)}")
    lines.append(_summary(result))
    return "\n".join(lines) + "\n"
