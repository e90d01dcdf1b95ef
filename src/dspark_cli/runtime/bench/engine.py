"""`dspark bench engine`: a running llama.cpp server's own step costs, measured in place, as the profile `dspark
plan` reads (measure/engine_profile.py has the document and the cost model).

    config = ProfileConfig(plain="http://127.0.0.1:8080", spec=[(7, "http://127.0.0.1:8081")],
                           concurrencies=(1, 2, 4), contexts=(64, 512), draft_file="draft.gguf", text=corpus)
    document = profile_engine(config)            # the dspark-engine-costs/1 document

Every figure is llama-server's own per-request timing (its `/completion` response, tools/server/server-common.cpp
of b11434: `prompt_ms` and `prompt_n`, `predicted_ms` from the end of the prompt to the last token, `predicted_n`
tokens generated, the first of them free from the prompt's logits, and with a draft `draft_n_accepted`):

- verify pass over M tokens: `prompt_ms` of a fresh M-token prompt (`cache_prompt` false: one forward over them);
- plain step of R requests at context c: R concurrent requests, each a c-token prompt (cached after the warm-up
  pass, so every repeat decodes from the same context) generating `generate` tokens with `ignore_eos`;
  `predicted_ms / (predicted_n - 1)`, the median over the R requests;
- speculative step: the same on a server drafting n tokens: `predicted_ms / (predicted_n - 1 -
  draft_n_accepted)` (a step emits its accepted draft tokens and one more).

Prompts are windows of real text (the corpus given, tokenized by the server), distinct per request. A warm-up
pass over every point comes first and is dropped; then `repeats` passes, each over every point in a rotated order
(grouped by context, so the slots' cached prompts change once per context), so sample i of every point was taken in
the same pass. The profile is labelled with the engine and its build, the
hardware of this machine (the engine's when its URL is local), and the model files' fingerprints, with the folder
each GGUF was converted from (dspark convert records it), which `dspark plan` matches against the eval runs.
Torch-free, stdlib HTTP and threads.
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.bench.serve import Endpoint
from dspark_cli.runtime.checkpoint.fingerprint import SOURCE_KEY, file_fingerprint
from dspark_cli.runtime.io.reading import server_error_message
from dspark_cli.runtime.measure.engine_profile import PROFILE_FORMAT

MAX_BODY = 16 << 20
PROBE_TIMEOUT_S = 10.0
MAX_REPEATS = 1000


@dataclass(frozen=True)
class ProfileConfig:
    plain: str  # the target alone
    spec: Sequence[tuple[int, str]]  # (draft tokens per round the server was started with, URL)
    concurrencies: Sequence[int]
    contexts: Sequence[int]
    text: str  # the corpus prompts are cut from
    draft_file: str  # the draft GGUF the speculative servers load (its block size, fingerprint and source)
    target_file: str | None = None  # default: the plain server's model_path when that file is here
    repeats: int = 5
    generate: int = 32
    timeout_s: float = 300.0
    engine_version: str | None = None  # default: the server's build_info


@dataclass(frozen=True)
class Server:
    url: str
    endpoint: Endpoint
    props: dict

    def post(self, path: str, body: dict, timeout_s: float) -> dict:
        """The JSON of POST prefix + path; DsparkError naming the server when it fails."""
        connection = self.endpoint.connect(timeout_s)
        try:
            connection.request("POST", self.endpoint.prefix + path, json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            payload = response.read(MAX_BODY)
            if response.status != 200:
                message = server_error_message(payload.decode("utf-8", "replace").strip())
                raise DsparkError(f"the server at {self.url} answered POST {path} with HTTP {response.status}: "
                                  f"{' '.join(message.split())[:300]}")
            document = json.loads(payload)
        except (OSError, http.client.HTTPException, ValueError) as error:
            raise DsparkError(f"the server at {self.url} failed POST {path} ({type(error).__name__}: {error}); "
                              "check that it is a running llama-server.") from None
        finally:
            connection.close()
        if not isinstance(document, dict):
            raise DsparkError(f"the server at {self.url} answered POST {path} with JSON that is not an object; "
                              "check that it is a running llama-server.")
        return document

    def timings(self, body: dict, timeout_s: float, keys: Sequence[str]) -> dict:
        """The `timings` of one POST /completion, holding a number under each of `keys` (llama-server's per-request
        timings); DsparkError naming the server when the answer has none."""
        timings = self.post("/completion", body, timeout_s).get("timings")
        missing = [key for key in keys if not isinstance(timings, dict) or not isinstance(timings.get(key),
                                                                                        (int, float))]
        if missing:
            raise DsparkError(f"the server at {self.url} answered POST /completion without timings.{missing[0]}; "
                              "`dspark bench engine` reads llama-server's per-request timings.")
        return timings


def connect(url: str, role: str) -> Server:
    """A llama-server (its GET /props); DsparkError in one sentence for anything else."""
    endpoint = Endpoint.parse(url, role)
    try:
        status, _, body = endpoint.get("/props", PROBE_TIMEOUT_S)
        props = json.loads(body) if status == 200 else None
    except (OSError, http.client.HTTPException, ValueError) as error:
        raise DsparkError(f"cannot reach the {role} at {endpoint.url} ({error}); start llama-server or check the "
                          "address.") from None
    if not isinstance(props, dict) or "build_info" not in props:
        raise DsparkError(f"the {role} at {endpoint.url} is not a llama-server (no build_info in GET /props): "
                          "`dspark bench engine` reads llama.cpp's per-request timings; for vLLM, SGLang or "
                          "TensorRT-LLM give `dspark plan` their own cost tables.")
    return Server(endpoint.url, endpoint, props)


def check_capacity(server: Server, role: str, config: ProfileConfig, block: int) -> None:
    slots = server.props.get("total_slots")
    n_ctx = (server.props.get("default_generation_settings") or {}).get("n_ctx")
    if isinstance(slots, int) and slots < max(config.concurrencies):
        raise DsparkError(f"the {role} at {server.url} has {slots} slots but the concurrency option asks for "
                          f"{max(config.concurrencies)}; start it with -np {max(config.concurrencies)} or more.")
    needed = max(config.contexts) + config.generate + block + 2
    if isinstance(n_ctx, int) and n_ctx < needed:
        raise DsparkError(f"the {role} at {server.url} gives each slot {n_ctx} tokens of context, but the largest "
                          f"context asked plus the generated tokens need {needed}; start it with a larger -c.")


def gguf_metadata(path: str, keys: Sequence[str]) -> dict:
    """Some metadata values of a GGUF file (None for absent keys); DsparkError when it is not one."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError, KeyError) as error:
        raise DsparkError(f"{path} is not a readable GGUF file ({error}); give the GGUF the server loads.") from None
    out = {}
    for key in keys:
        field = reader.get_field(key)
        out[key] = None if field is None else field.contents()
    return out


def model_file(path: str | None) -> dict:
    """{path, fingerprint, source} of a GGUF file (all None without one)."""
    if path is None:
        return {"path": None, "fingerprint": None, "source": None}
    source = gguf_metadata(path, [SOURCE_KEY])[SOURCE_KEY]
    return {"path": str(Path(path).resolve()), "fingerprint": file_fingerprint(path), "source": source}


def cpu_model() -> str:
    """This machine's CPU by name (Linux's /proc/cpuinfo; elsewhere what the platform module knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> str:
    """This machine: CPU model, cores, architecture (the GPU is not looked for: llama.cpp here runs on the CPU)."""
    return f"{cpu_model()}, {os.cpu_count()} logical cores, {platform.machine()}, {platform.system()}"


class Sampler:
    """The points of one profile and how to take one sample of each."""

    def __init__(self, plain: Server, spec: dict[int, Server], tokens: list[int], config: ProfileConfig, block: int):
        self.plain, self.spec, self.tokens, self.config = plain, spec, tokens, config
        self.verify_tokens = sorted({r * t for r in config.concurrencies for t in range(1, block + 2)})
        self.fresh = 0  # where the next fresh verify prompt starts in the token stream

    def groups(self) -> list[list[tuple]]:
        """The points in groups that share prompts: the verify passes, then each context's plain and speculative
        steps (so a pass switches the slots' cached prompts once per context, not once per point)."""
        groups: list[list[tuple]] = [[("verify", m) for m in self.verify_tokens]]
        for c in self.config.contexts:
            group = [("plain", r, c) for r in self.config.concurrencies]
            group += [("spec", n, r, c) for n in sorted(self.spec) for r in self.config.concurrencies]
            groups.append(group)
        return groups

    def order(self, repeat: int) -> list[tuple]:
        """Every point once: the groups and the points within each rotated by the pass number."""
        groups = self.groups()
        shift = max(repeat, 0)
        groups = groups[shift % len(groups):] + groups[:shift % len(groups)]
        return [job for group in groups for job in group[shift % len(group):] + group[:shift % len(group)]]

    def window(self, start: int, length: int) -> list[int]:
        stream = self.tokens
        return [stream[(start + i) % len(stream)] for i in range(length)]

    def verify(self, tokens: int) -> tuple[float, None]:
        prompt = self.window(self.fresh, tokens)
        self.fresh += tokens + 1
        timings = self.plain.timings({"prompt": prompt, "n_predict": 1, "cache_prompt": False, "temperature": 0},
                                     self.config.timeout_s, ("prompt_n", "prompt_ms"))
        if timings.get("prompt_n") != tokens:
            raise DsparkError(f"the plain server at {self.plain.url} processed {timings.get('prompt_n')} prompt "
                              f"tokens of a fresh {tokens}-token prompt; it must not reuse a cache here.")
        return float(timings["prompt_ms"]), None

    def decode(self, server: Server, requests: int, context: int) -> list[dict]:
        """The timings of R concurrent requests, request j on its own c-token window of the corpus."""
        timings: list[dict | None] = [None] * requests
        errors: list[BaseException] = []

        def one(j: int) -> None:
            prompt = self.window(j * (context + 97), context)
            body = {"prompt": prompt, "n_predict": self.config.generate, "ignore_eos": True, "temperature": 0,
                    "cache_prompt": True}
            try:
                timings[j] = server.timings(body, self.config.timeout_s, ("predicted_n", "predicted_ms"))
            except Exception as error:  # whatever failed, the profile is not measured: said in one sentence
                errors.append(error if isinstance(error, DsparkError) else DsparkError(
                    f"a request to the server at {server.url} failed ({type(error).__name__}: {error})."))

        threads = [threading.Thread(target=one, args=(j,), daemon=True) for j in range(requests)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return timings

    def plain_step(self, requests: int, context: int) -> tuple[float, None]:
        steps = [t["predicted_ms"] / max(t["predicted_n"] - 1, 1) for t in self.decode(self.plain, requests,
                                                                                        context)]
        return statistics.median(steps), None

    def spec_step(self, n: int, requests: int, context: int) -> tuple[float, float | None]:
        timings = self.decode(self.spec[n], requests, context)
        drafted = sum(t.get("draft_n", 0) for t in timings)
        accepted = sum(t.get("draft_n_accepted", 0) for t in timings)
        if drafted == 0:
            raise DsparkError(f"the server at {self.spec[n].url} drafted nothing: it is not speculating (started "
                              "without a draft model and a speculative type?); give a server that drafts.")
        steps = [t["predicted_ms"] / max(t["predicted_n"] - 1 - t.get("draft_n_accepted", 0), 1) for t in timings]
        return statistics.median(steps), accepted / drafted

    def sample(self, job: tuple) -> tuple[float, float | None]:
        kind, *point = job
        if kind == "verify":
            return self.verify(*point)
        if kind == "plain":
            return self.plain_step(*point)
        return self.spec_step(*point)


def profile_engine(config: ProfileConfig, on_sample: Callable[[tuple, int, float], None] | None = None) -> dict:
    """The profile document (module docstring). `on_sample(job, repeat, ms)` after each sample (repeat -1: the
    warm-up pass)."""
    check_config(config)
    plain = connect(config.plain, "plain server")
    spec = {n: connect(url, f"speculative server (n = {n})") for n, url in config.spec}
    block = draft_block_size(config.draft_file)
    for n, server in spec.items():
        if n > block:
            raise DsparkError(f"the speculative server at {server.url} is said to draft {n} tokens, more than the "
                              f"draft's block size {block} ({config.draft_file}); llama.cpp clamps it to {block}.")
        if server.props.get("model_path") != plain.props.get("model_path"):
            raise DsparkError(f"the speculative server at {server.url} serves {server.props.get('model_path')} but "
                              f"the plain server {plain.props.get('model_path')}; profile one target.")
    for role, server in [("plain server", plain)] + [(f"speculative server (n = {n})", s) for n, s in spec.items()]:
        check_capacity(server, role, config, block)
    target_file = config.target_file or local_file(plain.props.get("model_path"))
    tokens = plain.post("/tokenize", {"content": config.text}, config.timeout_s).get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise DsparkError(f"the plain server at {plain.url} answered POST /tokenize without a list of token ids; "
                          "check that it is a running llama-server.")
    if len(tokens) < 16:
        raise DsparkError("the prompts give fewer than 16 tokens; give a longer prompts file.")
    sampler = Sampler(plain, spec, tokens, config, block)
    jobs = sampler.order(0)
    samples: dict[tuple, list[float]] = {job: [] for job in jobs}
    acceptance: dict[tuple, list[float]] = {job: [] for job in jobs}
    for repeat in range(-1, config.repeats):
        for job in sampler.order(repeat):
            ms, accepted = sampler.sample(job)
            if repeat >= 0:
                samples[job].append(ms)
                if accepted is not None:
                    acceptance[job].append(accepted)
            if on_sample is not None:
                on_sample(job, repeat, ms)
    return {
        "format": PROFILE_FORMAT, "engine": "llamacpp",
        "engine_version": config.engine_version or str(plain.props["build_info"]),
        "hardware": hardware(), "models": {"target": model_file(target_file), "draft": model_file(config.draft_file)},
        "servers": {"plain": plain.url, "spec": {str(n): s.url for n, s in spec.items()}},
        "block_size": block, "repeats": config.repeats, "generate": config.generate,
        "measured_by": "dspark bench engine: llama-server's own per-request timings (prompt_ms of fresh prompts; "
                       "predicted_ms over the decode steps of concurrent requests)",
        "verify_ms": [{"tokens": job[1], "ms": samples[job]} for job in jobs if job[0] == "verify"],
        "plain_ms": [{"requests": job[1], "context": job[2], "ms": samples[job]} for job in jobs
                     if job[0] == "plain"],
        "spec_ms": [{"draft_n": job[1], "requests": job[2], "context": job[3], "ms": samples[job],
                     "acceptance": statistics.fmean(acceptance[job]) if acceptance[job] else None}
                    for job in jobs if job[0] == "spec"],
    }


def draft_block_size(path: str) -> int:
    """The block size a dflash GGUF was trained with (`dflash.block_size`)."""
    value = gguf_metadata(path, ["dflash.block_size"])["dflash.block_size"]
    if not isinstance(value, int) or value < 1:
        raise DsparkError(f"{path} has no dflash.block_size: give the draft GGUF the speculative servers load "
                          "(`dspark convert DRAFT` with the to option gguf).")
    return value


def local_file(path: object) -> str | None:
    return path if isinstance(path, str) and Path(path).is_file() else None


def check_config(config: ProfileConfig) -> None:
    if not config.spec:
        raise DsparkError("give at least one speculative server with the spec option (N=URL: the server drafts N "
                          "tokens a round).")
    if len({n for n, _ in config.spec}) != len(config.spec):
        raise DsparkError("two speculative servers draft the same number of tokens; give one per draft length.")
    if not config.concurrencies or min(config.concurrencies) < 1 or len(set(config.concurrencies)) < len(
            config.concurrencies):
        raise DsparkError("the concurrency option takes distinct integers >= 1 separated by commas, like 1,2,4.")
    if not config.contexts or min(config.contexts) < 1 or len(set(config.contexts)) < len(config.contexts):
        raise DsparkError("the context option takes distinct token counts >= 1 separated by commas, like 64,512.")
    if not 1 <= config.repeats <= MAX_REPEATS:
        raise DsparkError(f"the repeats option must be from 1 to {MAX_REPEATS}, got {config.repeats}.")
    if config.generate < 4:
        raise DsparkError(f"the generate option must be at least 4 tokens, got {config.generate}.")
    if not Path(config.draft_file).is_file():
        raise DsparkError(f"the draft file {config.draft_file} does not exist; give the GGUF the speculative "
                          "servers load.")
