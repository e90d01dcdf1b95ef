"""runtime/decode/chat.py: chat templates rendered with one-sentence failures, a deadline and a size limit."""

import threading
import time

import pytest

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.decode import chat


class FakeTokenizer:
    """apply_chat_template runs `render`; calling the tokenizer maps each character to its code point."""

    def __init__(self, render):
        self.render = render

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return self.render(messages[0]["content"])

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([0] if add_special_tokens else []) + [ord(c) for c in text]}


def test_a_result_that_is_not_text_is_refused():
    with pytest.raises(DsparkError, match="the chat template of T gave a list, not text"):
        chat.render_chat(FakeTokenizer(lambda text: [text]), "hi", "T")


def test_the_rendered_text_is_tokenized_without_extra_special_tokens():
    assert chat.encode_prompt(FakeTokenizer(lambda text: f"<{text}>"), "hi", True, "T") == [ord(c) for c in "<hi>"]
    assert chat.encode_prompt(FakeTokenizer(None), "hi", False, "T") == [0, ord("h"), ord("i")]


def test_a_slow_python_loop_is_interrupted_and_the_timer_is_cleared(monkeypatch):
    import signal

    monkeypatch.setattr(chat, "CHAT_TEMPLATE_SECONDS", 0.2)

    def spin(text):
        while True:
            time.sleep(0.01)

    start = time.monotonic()
    with pytest.raises(DsparkError, match="still rendering after 0.2 s"):
        chat.render_chat(FakeTokenizer(spin), "hi", "T")
    assert time.monotonic() - start < 5
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) in (
        signal.SIG_DFL, signal.default_int_handler, None)


def test_outside_the_main_thread_the_size_limit_still_applies(monkeypatch):
    monkeypatch.setattr(chat, "CHAT_TEMPLATE_MAX_CHARS", 10)
    errors = []

    def run():
        try:
            chat.render_chat(FakeTokenizer(lambda text: text * 20), "hi", "T")
        except DsparkError as error:
            errors.append(error.message)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert errors and "produced 40 characters" in errors[0]
