"""One serving engine as `dspark regen` talks to it: stdlib HTTP, JSON in and out, every failure one sentence.

Two APIs, each returning the token ids the server itself used and produced (never text tokenized again here):

- llama.cpp's own (tools/server, read at b11434): `/apply-template` renders the conversation with the server's chat
  template (what `/v1/chat/completions` would feed the model), `/tokenize` turns it into ids exactly as a
  completion does (special tokens added and parsed), and `/completion` runs those ids with `return_tokens`, whose
  `tokens` are the sampled ids (a stop token included) and `stop_type` eos / word / limit the finish reason.
- the OpenAI chat API (`/v1/chat/completions`) with the token-id extensions: vLLM's `return_token_ids` (the
  response's `prompt_token_ids`, the choice's `token_ids`; vllm/entrypoints/openai/chat_completion/protocol.py) and
  SGLang's `return_prompt_token_ids` / `return_token_ids` (the choice's `prompt_token_ids` and `token_ids`;
  python/sglang/srt/entrypoints/openai/protocol.py). A server that returns neither is refused.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, replace

from dspark_cli.errors import DsparkError, SettingError
from dspark_cli.runtime.io.reading import server_error_message

APIS = ("auto", "llamacpp", "openai")
PROBE = [{"role": "user", "content": "Hello"}]  # the one-token request that checks a server before any work
ERROR_BODY_CHARS = 300  # of a server's error message quoted in a record


@dataclass(frozen=True)
class Sampling:
    """What every request asks for. The defaults are DeepSpec's for Qwen3 (non-thinking): T 0.7, top-p 0.8,
    top-k 20, min-p 0; max_tokens is its 4096."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    min_p: float = 0.0
    max_tokens: int = 4096
    thinking: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SettingError("temperature", f"must be a finite number of at least 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise SettingError("top_p", f"must be above 0 and at most 1, got {self.top_p}.")
        if self.top_k < 0:
            raise SettingError("top_k", f"must be at least 0 (0: off), got {self.top_k}.")
        if not 0 <= self.min_p <= 1:
            raise SettingError("min_p", f"must be between 0 and 1, got {self.min_p}.")
        if self.max_tokens < 1:
            raise SettingError("max_tokens", f"must be at least 1, got {self.max_tokens}.")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Reply:
    """One assistant turn as the server produced it."""

    text: str
    prompt_token_ids: list[int]  # the ids the model read: the conversation so far, rendered by the server
    token_ids: list[int]  # the ids it sampled, a stop token included when the server returns it
    finish_reason: str  # "stop" (end of turn, a stop word) or "length" (max_tokens reached)
    reasoning: str | None = None  # a thinking model's separated reasoning, when the server splits it off


class ServerError(Exception):
    """One request failed: the message is one sentence for the error file."""


@dataclass(frozen=True)
class Server:
    """A server at `url` (no trailing slash, no /v1), the API spoken to it and the model named in requests."""

    url: str
    api: str
    model: str
    sampling: Sampling
    timeout: float

    def reply(self, messages: list[dict]) -> Reply:
        """The target's next assistant turn after `messages`; ServerError when the server fails."""
        return (_llamacpp_reply if self.api == "llamacpp" else _openai_reply)(self, messages)

    def get(self, path: str) -> object:
        return self._call(urllib.request.Request(self.url + path), path)

    def post(self, path: str, body: dict) -> object:
        request = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        return self._call(request, path)

    def _call(self, request: urllib.request.Request, path: str) -> object:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                data = response.read()
        except urllib.error.HTTPError as error:
            raise ServerError(f"the server answered {path} with HTTP {error.code}: {_error_text(error)}.") from None
        except (TimeoutError, socket.timeout):
            raise ServerError(f"the server did not answer {path} within {self.timeout:g} s (the timeout "
                              "option).") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", None) or error
            raise ServerError(f"cannot reach the server at {self.url} ({reason}).") from None
        except http.client.HTTPException as error:  # a reply cut mid-body, a first line that is not HTTP, ...
            raise ServerError(f"the server's answer to {path} broke off or is not HTTP ({type(error).__name__}: "
                              f"{str(error)[:80] or 'no detail'}).") from None
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise ServerError(f"the server answered {path} with something that is not JSON: "
                              f"{data[:80]!r}.") from None


def _error_text(error: urllib.error.HTTPError) -> str:
    """The message of an HTTP error's body (io.reading.server_error_message), else its reason."""
    try:
        raw = error.read().decode("utf-8", errors="replace")
    except OSError:
        raw = ""
    return (server_error_message(raw) or str(error.reason)).strip()[:ERROR_BODY_CHARS]


# --- connecting ------------------------------------------------------------------------------------------------


def base_url(url: str) -> str:
    """`http(s)://host[:port][/prefix]` without a trailing slash or /v1 (OpenAI clients' base URLs end in /v1)."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise SettingError("url", f"{url!r} is not an http:// or https:// address of a server; give e.g. "
                           "http://127.0.0.1:8080.")
    try:
        parsed.port
    except ValueError:
        raise SettingError("url", f"{url!r} has a port that is not a number from 0 to 65535.") from None
    path = parsed.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


def connect(url: str, sampling: Sampling, api: str = "auto", model: str | None = None,
            timeout: float = 600.0) -> Server:
    """The server at `url`, checked before any work: its models (/v1/models), the API (llama.cpp when /props
    answers as llama-server does, else OpenAI), the model to name, and one one-token request through that API.
    DsparkError (one sentence) when it cannot be reached, does not serve `model` or fails the request."""
    if api not in APIS:
        raise SettingError("api", f"{api!r} is not an API; choose {', '.join(APIS)}.")
    if not (math.isfinite(timeout) and timeout > 0):
        raise SettingError("timeout", f"must be a number of seconds above 0, got {timeout}.")
    probe = Server(base_url(url), "openai", "", sampling, timeout)
    try:
        listed = probe.get("/v1/models")
    except ServerError as error:
        raise DsparkError(f"{error} Start the server, or give its address with the url option.") from None
    names = [entry.get("id") for entry in listed.get("data", [])
             if isinstance(entry, dict) and isinstance(entry.get("id"), str)] if isinstance(listed, dict) else []
    if model is not None and names and model not in names:
        raise DsparkError(f"the server at {probe.url} serves {', '.join(names)}, not {model}; pass one of them with "
                          "the model option.")
    if model is None and not names:
        raise DsparkError(f"the server at {probe.url} lists no model at /v1/models; name it with the model option.")
    if api == "auto":
        api = "llamacpp" if _is_llamacpp(probe) else "openai"
    server = Server(probe.url, api, model or names[0], sampling, timeout)
    try:  # one token, as DeepSpec's script checks its servers: an API that cannot give token ids fails here, once
        Server(server.url, api, server.model, replace(sampling, max_tokens=1), timeout).reply(PROBE)
    except ServerError as error:
        raise DsparkError(f"the server at {server.url} failed a one-token request through the {api} API: {error} "
                          "Check the api option, or serve the target with an engine that returns token ids.") from None
    return server


def _is_llamacpp(probe: Server) -> bool:
    try:
        props = probe.get("/props")
    except ServerError:
        return False
    return isinstance(props, dict) and "default_generation_settings" in props


# --- the two APIs ----------------------------------------------------------------------------------------------


def _template_kwargs(server: Server) -> dict:
    return {"chat_template_kwargs": {"enable_thinking": server.sampling.thinking}}


def _llamacpp_reply(server: Server, messages: list[dict]) -> Reply:
    rendered = server.post("/apply-template", {"messages": messages, **_template_kwargs(server)})
    prompt = _field(rendered, "prompt", str, "/apply-template")
    tokenized = server.post("/tokenize", {"content": prompt, "add_special": True, "parse_special": True})
    prompt_ids = _ids(_field(tokenized, "tokens", list, "/tokenize"), "/tokenize")
    s = server.sampling
    body = {"prompt": prompt_ids, "n_predict": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "top_k": s.top_k, "min_p": s.min_p, "return_tokens": True, "cache_prompt": True}
    done = server.post("/completion", body)
    stop_type = _field(done, "stop_type", str, "/completion")
    return Reply(text=_field(done, "content", str, "/completion"), prompt_token_ids=prompt_ids,
                 token_ids=_ids(_field(done, "tokens", list, "/completion"), "/completion"),
                 finish_reason="length" if stop_type == "limit" else "stop")


def _openai_reply(server: Server, messages: list[dict]) -> Reply:
    s = server.sampling
    body = {"model": server.model, "messages": messages, "max_tokens": s.max_tokens, "temperature": s.temperature,
            "top_p": s.top_p, "top_k": s.top_k or -1,  # SGLang takes -1, not 0, for "off"; vLLM takes both
            "min_p": s.min_p, "stream": False, "return_token_ids": True,
            "return_prompt_token_ids": True, "skip_special_tokens": True, **_template_kwargs(server)}
    done = server.post("/v1/chat/completions", body)
    choices = _field(done, "choices", list, "/v1/chat/completions")
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    prompt_ids = done.get("prompt_token_ids") or choice.get("prompt_token_ids")
    token_ids = choice.get("token_ids")
    if prompt_ids is None or token_ids is None:
        raise ServerError("the server returned no token ids with its reply (vLLM returns them for return_token_ids, "
                          "SGLang for return_token_ids and return_prompt_token_ids; llama-server through its own "
                          "API); serve the target with one of them.")
    return Reply(text=message.get("content") or "", prompt_token_ids=_ids(prompt_ids, "/v1/chat/completions"),
                 token_ids=_ids(token_ids, "/v1/chat/completions"),
                 finish_reason=str(choice.get("finish_reason") or "stop"),
                 reasoning=message.get("reasoning_content") or message.get("reasoning"))


def _field(document: object, key: str, kind: type, path: str):
    value = document.get(key) if isinstance(document, dict) else None
    if not isinstance(value, kind):
        raise ServerError(f"the server's answer to {path} has no {kind.__name__} '{key}' (is it the API it was taken "
                          "for? see the api option).")
    return value


def _ids(values: list, path: str) -> list[int]:
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ServerError(f"the server's answer to {path} holds token ids that are not non-negative integers.")
    return list(values)
