"""One engine as `dspark bench audit` talks to it: prompts as token ids in, generated token ids and the engine's
own drafting counts out. Stdlib HTTP (serve.py's Endpoint, engine.py's JSON POST), torch-free.

    server = connect_audit("http://127.0.0.1:8081", "speculative", engine="auto", model=None, timeout_s=120)
    ids = server.tokenize("def parse(line):")                  # the engine's own ids (llama.cpp), else None
    done = server.complete(ids, 64, GREEDY, seed=0)            # Completion: tokens, drafted, accepted

Two APIs, every id the server's own (never text tokenized again here):
- llama.cpp (tools/server of b11434): `/tokenize` (special tokens added and parsed, as a completion does),
  `/completion` with the prompt as ids and `return_tokens` (the sampled ids), its `timings.draft_n` /
  `draft_n_accepted` per response (server-common.cpp, present only when the slot drafted).
- vLLM and SGLang: `/v1/completions` with the prompt as ids and `return_token_ids` (the choice's `token_ids`;
  vllm/entrypoints/openai/completion/protocol.py, python/sglang/srt/entrypoints/openai/protocol.py). A text prompt
  is sent once to read `prompt_token_ids` back. vLLM's drafting per request: its spec_decode counters read before
  and after the request (requests are sent one at a time at T = 0); SGLang keeps no per-request counts, only its
  mean accept length since start (engine_metrics.py), read once for the whole run.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.bench.engine import Server as JsonServer
from dspark_cli.runtime.bench.engine_metrics import SglangSpec, SpecCounters, llamacpp_draft_counts
from dspark_cli.runtime.bench.serve import Server, probe

SGLANG_TOP_K_OFF = -1  # SGLang takes -1 for "off"; llama.cpp and vLLM take 0


@dataclass(frozen=True)
class Sampling:
    """What a request asks for; temperature 0 is greedy (llama.cpp also gets top_k 1, as its own greedy does)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


GREEDY = Sampling()


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    drafted: int | None  # draft tokens the engine proposed for this request; None: it reports none per request
    accepted: int | None


@dataclass
class AuditServer:
    server: Server  # role, endpoint, engine ("llamacpp", "vllm", "sglang", "openai"), model
    timeout_s: float
    counters_lock: threading.Lock

    @property
    def role(self) -> str:
        return self.server.role

    @property
    def engine(self) -> str:
        return self.server.engine

    @property
    def url(self) -> str:
        return self.server.endpoint.url

    def _post(self, path: str, body: dict) -> dict:
        answer = JsonServer(self.url, self.server.endpoint, {}).post(path, body, self.timeout_s)
        if not isinstance(answer, dict):
            raise DsparkError(f"the {self.role} server at {self.url} answered POST {path} with something that is "
                              "not a JSON object; give the address of llama-server, vLLM or SGLang.")
        return answer

    def tokenize(self, text: str) -> list[int]:
        """The ids the engine reads for `text`: llama.cpp's /tokenize, else the prompt_token_ids of a one-token
        completion of the text."""
        if self.engine == "llamacpp":
            answer = self._post("/tokenize", {"content": text, "add_special": True, "parse_special": True})
            return _ids(answer.get("tokens"), self, "/tokenize")
        answer = self._post("/v1/completions", self._openai_body(text, 1, GREEDY, 0))
        choice = _first_choice(answer, self)
        return _ids(answer.get("prompt_token_ids") or choice.get("prompt_token_ids"), self, "/v1/completions")

    def detokenize(self, ids: list[int]) -> str | None:
        """Text of `ids` by the engine's detokenizer (llama.cpp's and vLLM's /detokenize); None without one."""
        if self.engine == "llamacpp":
            text = self._post("/detokenize", {"tokens": ids}).get("content")
        elif self.engine == "vllm":
            text = self._post("/detokenize", {"tokens": ids, "model": self.server.model}).get("prompt")
        else:
            return None
        return text if isinstance(text, str) else None

    def complete(self, ids: list[int], max_tokens: int, sampling: Sampling, seed: int) -> Completion:
        """`max_tokens` generated after the prompt `ids` (end of sequence ignored), and the engine's drafting."""
        if self.engine == "llamacpp":
            body = {"prompt": ids, "n_predict": max_tokens, "temperature": sampling.temperature,
                    "top_k": 1 if sampling.greedy else sampling.top_k, "top_p": sampling.top_p, "min_p": 0.0,
                    "seed": seed, "ignore_eos": True, "return_tokens": True, "cache_prompt": not sampling.greedy}
            answer = self._post("/completion", body)
            drafted, accepted = llamacpp_draft_counts(answer.get("timings"))
            return Completion(_ids(answer.get("tokens"), self, "/completion"), drafted, accepted)
        with self.counters_lock:  # vLLM: counters around this request alone (greedy requests go one at a time)
            before = self.server.snapshot() if sampling.greedy else None
            answer = self._post("/v1/completions", self._openai_body(ids, max_tokens, sampling, seed))
            after = self.server.snapshot() if sampling.greedy else None
        tokens = _ids(_first_choice(answer, self).get("token_ids"), self, "/v1/completions")
        if isinstance(after, SpecCounters):
            counts = after.since(before if isinstance(before, SpecCounters) else None)
            return Completion(tokens, int(counts.draft_tokens), int(counts.accepted))
        return Completion(tokens, None, None)

    def _openai_body(self, prompt: list[int] | str, max_tokens: int, sampling: Sampling, seed: int) -> dict:
        top_k = sampling.top_k or (SGLANG_TOP_K_OFF if self.engine == "sglang" else 0)
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "top_k": 1 if sampling.greedy else top_k, "min_p": 0.0, "seed": seed,
                "ignore_eos": True, "stream": False, "return_token_ids": True}
        if self.server.model is not None:
            body["model"] = self.server.model
        return body

    def mean_accept_length(self) -> float | None:
        """SGLang's mean accept length since it started (its server info), None for other engines."""
        spec = self.server.snapshot() if self.engine == "sglang" else None
        return spec.avg_accept_length if isinstance(spec, SglangSpec) else None


def connect_audit(url: str, role: str, engine: str, model: str | None, timeout_s: float) -> AuditServer:
    """The server at `url` (serve.probe: /v1/models, the engine told apart), llama.cpp also known by its /props."""
    server = probe(url, role, engine, model)
    if engine == "auto" and server.engine == "openai":
        props = server._json("/props")
        server.engine = "llamacpp" if isinstance(props, dict) and "default_generation_settings" in props else "openai"
    return AuditServer(server, timeout_s, threading.Lock())


def _first_choice(answer: dict, server: AuditServer) -> dict:
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise DsparkError(f"the {server.role} server at {server.url} returned no completion choice; give the "
                          "address of llama-server, vLLM or SGLang.")
    return choices[0]


def _ids(values: object, server: AuditServer, path: str) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in values):
        raise DsparkError(f"the {server.role} server at {server.url} returned no token ids from {path} (llama.cpp "
                          "returns them with return_tokens, vLLM and SGLang with return_token_ids); serve the model "
                          "with one of them, or pass the engine option if it was taken for another.")
    return list(values)
