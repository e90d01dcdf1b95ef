"""Prompts to token ids: the tokenizer's chat template, rendered with bounded time and size.

A chat template is a Jinja program shipped with the tokenizer; transformers renders it in Jinja's
sandbox, which stops attribute tricks but not runaway work: a template can fail on every prompt
(an undefined filter, `raise_exception`, a type error) or loop for minutes while its output grows
by gigabytes. `render_chat` turns every failure into one sentence naming the template, and bounds
the cost: on POSIX in the main thread a SIGALRM timer interrupts rendering after
CHAT_TEMPLATE_SECONDS (Jinja's compiled templates are Python code, so the interrupt lands between
two steps of a loop; in ~10 s a loop grows the output list by a few hundred MB at most), and a
rendered text longer than CHAT_TEMPLATE_MAX_CHARS is refused before it is tokenized. Elsewhere
(another thread, Windows) there is no timer; the size limit still applies. A template that builds
one huge string in a single C-level step (`"x" * 10**10`) is only caught by the size check after
Python has allocated it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator

from dspark_cli.errors import DsparkError

CHAT_TEMPLATE_SECONDS = 10.0
CHAT_TEMPLATE_MAX_CHARS = 16 * 2**20  # far beyond any model's context in characters


class _TemplateTimeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise _TemplateTimeout in the block after `seconds` (POSIX main thread; elsewhere a no-op)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _TemplateTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def render_chat(tokenizer, text: str, source: str, thinking: bool | None = None) -> str:
    """One user message through the tokenizer's chat template (with the generation prompt) -> text.
    thinking: passed as the template's enable_thinking (None: not passed). DsparkError, naming `source`
    (where the tokenizer came from), when the template fails or runs away."""
    options = {} if thinking is None else {"enable_thinking": thinking}
    return bounded_render(
        lambda: tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True, **options),
        f"the chat template of {source}", "fix the template or pass the no-chat option")


def bounded_render(render: Callable[[], object], where: str, remedy: str) -> str:
    """Run `render` (a chat-template rendering) with the time and size bounds; every failure is a DsparkError
    sentence "<where> <what happened>; <remedy>."."""
    try:
        with _deadline(CHAT_TEMPLATE_SECONDS):
            rendered = render()
    except _TemplateTimeout:
        raise DsparkError(f"{where} was still rendering after {CHAT_TEMPLATE_SECONDS:g} s (a runaway loop?); "
                          f"{remedy}.") from None
    except MemoryError:
        raise DsparkError(f"{where} ran out of memory while rendering; {remedy}.") from None
    except Exception as error:  # anything raised while the sandbox runs the template is the template's failure
        raise DsparkError(f"{where} fails: {type(error).__name__}: {error}; {remedy}.") from error
    if not isinstance(rendered, str):
        raise DsparkError(f"{where} gave a {type(rendered).__name__}, not text; {remedy}.")
    if len(rendered) > CHAT_TEMPLATE_MAX_CHARS:
        raise DsparkError(f"{where} produced {len(rendered):,} characters for one prompt (the limit is "
                          f"{CHAT_TEMPLATE_MAX_CHARS:,}); {remedy}.")
    return rendered


def encode_prompt(tokenizer, text: str, chat: bool, source: str, thinking: bool | None = None) -> list[int]:
    """Token ids of one prompt: through the chat template (whose text carries its own special tokens), or the
    plain text with the tokenizer's special tokens. thinking: the template's enable_thinking (None: not passed)."""
    if chat:
        return tokenizer(render_chat(tokenizer, text, source, thinking), add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]
