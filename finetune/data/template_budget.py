"""Rendering a chat template within a budget of time and memory: the one way finetune renders one.

A chat template is code from a tokenizer or a recipe. transformers runs it in Jinja's immutable sandbox, which
keeps it from Python's internals but not from hanging (loops over loops over the messages) or from allocating
a string of gigabytes in one operation (`{{ 'a' * 3000000000 }}`: issue 34 saw 6 GB before a time limit could
act). Every render here (data show, tokenizing, preflight and --dry-run, eval, chat) goes through `render` or
`render_with_spans`, which:

- compile the template in `BoundedSandbox`: transformers' sandbox (its filters, globals and `{% generation %}`
  extension, taken from its own compiled environment, so they stay what transformers renders with) that also
  refuses, before computing it, any value longer than MAX_CHARS: `*` and `**` on huge operands, `+`, `~` and
  joined output past the cap, a length past it given to a filter or str method (`center(3e9)`), a format
  width past it (`'%999999999s'`), a `replace` that would grow past it;
- stop the render after `seconds` (SIGALRM on the main thread; a deadline checked at every call elsewhere).

Both raise TemplateBudget, a finetune.data.formats.RowProblem: the caller names the file and row.
"""

from __future__ import annotations

import contextlib
import functools
import re
import signal
import threading
import time
from typing import Any, Iterator, Optional

from finetune.data.formats import RowProblem

# The longest value a template may build: a rendered 1M-token conversation is 4-8 M characters.
MAX_CHARS = 32 * 2**20
# One render (one conversation, or one prefix of it): an ordinary template takes milliseconds.
RENDER_SECONDS = 5.0


class TemplateBudget(RowProblem):
    """A render that ran past its time or would have built a value past MAX_CHARS."""


_deadline = threading.local()


class time_budget:  # noqa: N801 - used as a context manager, like a function
    """Renders inside stop after `seconds` with TemplateBudget: SIGALRM interrupts any Python code on the main
    thread; elsewhere (no signals there) the sandbox checks the deadline at each call and operator. Inside
    another budget, the earlier deadline holds. (A class: a generator context manager costs a render 5 us more.)"""

    __slots__ = ("seconds", "outer", "handler")

    def __init__(self, seconds: Optional[float] = None):
        self.seconds = RENDER_SECONDS if seconds is None else seconds

    def __enter__(self) -> None:
        self.outer = getattr(_deadline, "at", None), getattr(_deadline, "seconds", self.seconds)
        at, seconds = time.monotonic() + self.seconds, self.seconds
        if self.outer[0] is not None and self.outer[0] < at:
            at, seconds = self.outer
        _deadline.at, _deadline.seconds = at, seconds
        self.handler = None
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            self.handler = alarm_handler()
            self.handler.__enter__()
            signal.setitimer(signal.ITIMER_REAL, max(at - time.monotonic(), 0.01))

    def __exit__(self, *exc_info) -> None:
        _deadline.at, _deadline.seconds = self.outer
        if self.handler is not None:
            at = self.outer[0]
            signal.setitimer(signal.ITIMER_REAL, 0 if at is None else max(at - time.monotonic(), 0.01))
            self.handler.__exit__(*exc_info)


@contextlib.contextmanager
def alarm_handler() -> Iterator[None]:
    """The budget's SIGALRM handler, installed for the block (on the main thread): around a batch of renders it
    saves each render's two handler swaps (13 us of the 40 us a budget costs a render)."""
    previous = signal.getsignal(signal.SIGALRM)
    if previous is _expire or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGALRM, _expire)
    try:
        yield
    finally:
        signal.signal(signal.SIGALRM, previous)


def _expire(signum, frame) -> None:
    raise TemplateBudget(_slow())


def _slow() -> str:
    return (f"the chat template did not finish rendering this conversation in {_deadline.seconds:g} s (loops over "
            "loops?); tokenizing the dataset would take as long for every row")


def _check_deadline() -> None:
    at = getattr(_deadline, "at", None)
    if at is not None and time.monotonic() > at:
        raise TemplateBudget(_slow())


def _too_big(what: str) -> TemplateBudget:
    return TemplateBudget(f"the chat template builds {what} longer than {MAX_CHARS:,} characters "
                          "(a template that multiplies a string?)")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _bounded_concat(pieces) -> str:
    """`"".join(pieces)`, stopped once past MAX_CHARS: the render's output, a macro's, a `{% set %}` block's."""
    kept, total = [], 0
    for piece in pieces:
        total += len(piece)
        if total > MAX_CHARS:
            raise _too_big("an output")
        kept.append(piece)
    return "".join(kept)


# A printf width or precision (`%999999999s`), or a str.format one (`{:>999999999}`).
_FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\d+)?(?:\.(\d+))?|\{[^{}]*?:[^{}]*?(\d+)[^{}]*\}")
_SIZE_METHODS = {"ljust", "rjust", "center", "zfill", "expandtabs"}  # str methods whose number is a length
_SIZE_FILTERS = {"center", "indent", "wordwrap", "truncate", "batch", "slice"}  # Jinja filters likewise


def _check_sizes(values) -> None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_CHARS:
            raise _too_big(f"a value from the length {value:.3g}")


def _check_format(text: Any) -> None:
    if not isinstance(text, str):
        return
    for match in _FORMAT_WIDTH.finditer(text):
        if any(group and (len(group) > 9 or int(group) > MAX_CHARS) for group in match.groups()):
            raise _too_big("a formatted string")


def _check_replace(text: Any, args: tuple) -> None:
    if isinstance(text, str) and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        grows = len(args[1]) - len(args[0])
        if grows > 0 and len(text) + (text.count(args[0]) if args[0] else len(text) + 1) * grows > MAX_CHARS:
            raise _too_big("a replaced string")


def _check_join(separator: Any, items: Any) -> None:
    """A join of many references to one long string is gigabytes from a list that holds a few hundred."""
    if isinstance(items, (list, tuple)):
        total = sum(_size(item) if isinstance(item, str) else 0 for item in items) + _size(separator) * len(items)
        if total > MAX_CHARS:
            raise _too_big("a joined value")


def _check_method(method: Any, args: tuple, kwargs: dict) -> None:
    """Before a str method runs: the result it would build, from its arguments."""
    method = getattr(method, "__wrapped__", method)  # Jinja 3.1.5+ hands str.format out wrapped (wrap_str_format)
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in _SIZE_METHODS:
        _check_sizes((*args, *kwargs.values()))
    elif name in ("format", "format_map"):
        _check_format(owner)
    elif name == "replace":
        _check_replace(owner, args)
    elif name == "join" and args:
        _check_join(owner, args[0])


def _bounded_filter(name: str, fn):
    """Jinja's filter `name`, refusing what would build a value past MAX_CHARS (its size parameters checked before
    it runs, its result after)."""
    skip = 1 if getattr(fn, "jinja_pass_arg", None) else 0  # the context or environment Jinja passes first

    @functools.wraps(fn)  # keeps jinja_pass_arg
    def call(*args, **kwargs):
        _check_deadline()
        value, params = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        if name in _SIZE_FILTERS:
            _check_sizes((*params, *kwargs.values()))
        elif name == "format":
            _check_format(value)
        elif name == "replace":
            _check_replace(value, params)
        elif name == "join":
            _check_join(params[0] if params else kwargs.get("d", ""), value)
        result = fn(*args, **kwargs)
        if _size(result) > MAX_CHARS:
            raise _too_big("a value")
        return result
    return call


def _sandbox_classes():
    """(BoundedSandbox, its code generator): defined on first use, when jinja2 is imported (with transformers)."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedGenerator(CodeGenerator):
        def visit_Concat(self, node, frame) -> None:
            """`a ~ b` through the environment's bounded join (Jinja writes str_join, which no hook reaches)."""
            if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
                return super().visit_Concat(node, frame)
            self.write("environment.concat(map(str, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write(")))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedGenerator
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        concat = staticmethod(_bounded_concat)

        def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
            _check_deadline()
            if operator == "*":
                count, sized = (right, left) if isinstance(right, int) else (left, right)
                if isinstance(count, int) and _size(sized) * max(count, 0) > MAX_CHARS:
                    raise _too_big("a repeated value")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                    and abs(left) > 1 and right * max(abs(left), 2).bit_length() > 8 * MAX_CHARS:
                raise _too_big("a number")
            elif operator == "+" and _size(left) + _size(right) > MAX_CHARS:
                raise _too_big("a joined value")
            elif operator == "%" and isinstance(left, str):
                _check_format(left)
            result = super().call_binop(context, operator, left, right)
            if _size(result) > MAX_CHARS:
                raise _too_big("a value")
            return result

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
            _check_deadline()
            _check_method(__obj, args, kwargs)
            result = super().call(__context, __obj, *args, **kwargs)
            if _size(result) > MAX_CHARS:
                raise _too_big("a value")
            return result

    return BoundedSandbox


@functools.lru_cache(maxsize=1)
def _environment():
    """A BoundedSandbox configured as transformers configures its own (read off its compiled environment)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    base = _compile_jinja_template("").environment
    env = _sandbox_classes()(trim_blocks=base.trim_blocks, lstrip_blocks=base.lstrip_blocks,
                             extensions=[type(extension) for extension in base.extensions.values()])
    env.globals.update(base.globals)
    env.filters.update({name: _bounded_filter(name, fn) for name, fn in base.filters.items()})
    env.tests.update(base.tests)
    return env


@functools.lru_cache(maxsize=32)
def compile_template(template: str):
    """`template` compiled in the bounded sandbox (jinja2.TemplateSyntaxError when it is not Jinja)."""
    return _environment().from_string(template)


def _collect(blocks: Iterator[str], into: list) -> str:
    total = 0
    for block in blocks:
        total += len(block)
        if total > MAX_CHARS:
            raise _too_big("an output")
        into.append(block)
    return "".join(into)


def render(template: str, messages: list, add_generation_prompt: bool = False, seconds: Optional[float] = None,
           **kwargs: Any) -> str:
    """`template` rendered for `messages` (already in the form transformers hands a template) within the budget
    (`seconds`, default RENDER_SECONDS); `kwargs`: the other variables (the special tokens, tools, documents)."""
    compiled = compile_template(template)
    with time_budget(RENDER_SECONDS if seconds is None else seconds):
        return _collect(compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                          **{"tools": None, "documents": None, **kwargs}), [])


def render_with_spans(template: str, messages: list, seconds: Optional[float] = None,
                      **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
    """(text, character spans of the `{% generation %}` blocks): what apply_chat_template's assistant mask is
    computed from (transformers' AssistantTracker extension, activated as transformers activates it)."""
    compiled = compile_template(template)
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    with time_budget(RENDER_SECONDS if seconds is None else seconds), compiled.environment.activate_tracker(blocks, spans):
        text = _collect(compiled.generate(messages=messages, add_generation_prompt=False,
                                          **{"tools": None, "documents": None, **kwargs}), blocks)
    return text, spans


def tokenizer_kwargs(tokenizer) -> dict[str, Any]:
    """What apply_chat_template passes a template besides the conversation: the special tokens, as plain data."""
    from transformers.utils.chat_template_utils import _plain_template_data

    return _plain_template_data(dict(tokenizer.special_tokens_map))


def chat_messages(messages: list) -> list:
    """`messages` as render_jinja_template hands them to a template (None values dropped, reasoning aliased)."""
    from transformers.utils.chat_template_utils import _alias_reasoning_fields, _plain_template_data

    return _alias_reasoning_fields(_plain_template_data([{k: v for k, v in m.items() if v is not None}
                                                        for m in messages]))


def template_of(tokenizer) -> Optional[str]:
    """The tokenizer's chat template text, or None when it has none."""
    try:
        return tokenizer.get_chat_template()
    except ValueError:  # transformers: "Cannot use chat template functions because ... not set"
        return None


def render_for(tokenizer, messages: list, add_generation_prompt: bool = False) -> str:
    """`tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`, within the budget;
    a template that fails on them is a RowProblem."""
    template = template_of(tokenizer)
    if template is None:
        raise RowProblem("the tokenizer has no chat template")
    try:
        return render(template, chat_messages(messages), add_generation_prompt, **tokenizer_kwargs(tokenizer))
    except TemplateBudget:
        raise
    except Exception as exc:  # noqa: BLE001 - the template is code: it raises what it likes (raise_exception)
        raise RowProblem(f"the chat template cannot render this conversation: {exc}") from None
