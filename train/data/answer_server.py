"""A client for OpenAI-compatible serving engines (vLLM, SGLang, llama.cpp's `llama-server`) that
answers conversations for `served_answers`, and the check that a server serves the target.

SpecForge regenerates its training answers through an SGLang server, speculators through vLLM:
engines batch every request in flight, page their KV caches and run on as many machines as there
are URLs. specdec keeps the rendering: each context goes through the *target's* chat template
here (`conversations.context_ids`) and is sent to `/v1/completions` as token ids (vLLM, SGLang and
llama.cpp take a list of ints as the prompt; a server that refuses it gets the rendered text with
`add_special_tokens: false`, the template writing its own BOS). A request asks for
`max_tokens`, the conversation's temperature with nothing else cutting the distribution (top_p 1,
top_k -1, min_p 0: the in-process path samples the whole softmax, and llama.cpp's defaults would cut
its tail), a seed, and a stop at the template's end-of-turn token (`stop_token_ids` for vLLM and
SGLang; llama.cpp stops at its end-of-generation tokens).
`finish_reason` "stop" is an answer that reached its end of turn, "length" one cut at max_tokens.

`ServerPool` keeps at most `in_flight` requests on each server and fans requests out over every
URL; a failed request (no connection, HTTP 5xx/408/429, a body that is not a whole answer: no
choice, no text, no finish_reason, or "length" before max_tokens) is retried on the next free slot
after an exponential backoff (`Retry`). A server that fails `Retry.attempts` requests in a row is
dropped; when none is left, or one request fails `Retry.attempts` times, the pool raises
`SpecdecError`, one line, and the caller keeps what it finished.

`check_server` refuses, before any work and in one line, a URL that does not answer, one that is
not an OpenAI-compatible server (`/v1/models` is not a model list), one whose context is shorter
than the rows, and one that serves another tokenizer or other weights than the in-process target
(`Reference`):

- tokenizer: a fixed text (chat markup, code, digits, accents, emoji) tokenized by the server's
  `/tokenize` (llama.cpp, vLLM, SGLang) must be the target tokenizer's ids exactly; a server without
  the endpoint is compared on its continuations alone (sent as token ids, another vocabulary
  answers garbage).
- weights: `PROBE_TOKENS` greedy tokens of each of the `PROBES` (open prompts: models differ on
  their first words) from the server and from the target. Every probe the same text: the same
  weights. Else the server is taken for a quantized copy (a 4-bit llama.cpp GGUF, an FP8 vLLM
  checkpoint) when, on every probe, its text agrees with at least the target's first
  `PROBE_AGREE` tokens: a quantized copy follows the greedy path until two near-tied logits swap,
  another model leaves it within the first words. Anything else is refused. The verdict
  ("same" or "quantized") is recorded with the server's identity (`ServerInfo.describe`: its
  `/v1/models` entry and what `/props`, `/version` or `/get_model_info` report).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec_models.errors import SpecdecError, check

from .conversations import Turn, context_ids

PROBES = ("Write one sentence about the sea.", "Tell me a fact about the moon.",
          "Describe your favourite food in a few words.", "Write a Python function that reverses a string.")
PROBE_TOKENS = 16
PROBE_AGREE = 4
TOKENIZE_TEXT = ("<|im_start|>user\nHello, world! Numbers 1234567 and 3.14159; naïve café, 東京, emoji 🙂.\n"
                 "def f(x):\n    return x ** 2  # tabs\tand  spaces<|im_end|>\n")
TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}


class Transient(Exception):
    """A request that may succeed when tried again (the connection, a 5xx, a cut or empty answer)."""


@dataclass(frozen=True)
class Retry:
    """How failed requests are retried: `attempts` tries in all, waiting `backoff` seconds after the
    first failure, `factor` times longer after each next, at most `most`; `timeout` seconds per
    request (a long answer on a loaded server takes minutes)."""
    attempts: int = 5
    backoff: float = 1.0
    factor: float = 2.0
    most: float = 30.0
    timeout: float = 600.0


@dataclass(frozen=True)
class Completion:
    """One answer: its text, whether it reached the end of turn, and the tokens generated (the
    end-of-turn token included)."""
    text: str
    ended: bool
    tokens: int


@dataclass(frozen=True)
class Request:
    """One completion to ask for: the rendered context (`ids`, and `text` for a server that takes no
    ids), at most `max_tokens` new tokens, at `temperature` with `seed`."""
    ids: list[int]
    text: str
    max_tokens: int
    temperature: float
    seed: int
    where: str = ""              # for messages: which conversation and turn


@dataclass
class Reference:
    """The in-process target a server is checked against: its tokenizer, end-of-turn token,
    `greedy(ids, n) -> ids` (n greedy tokens, stopping after the end-of-turn token), the chat
    template kwargs and the target's identity."""
    tokenizer: Any
    end_of_turn: int
    greedy: Callable[[list[int], int], list[int]]
    chat_template_kwargs: dict = field(default_factory=dict)
    identity: dict = field(default_factory=dict)


def normalize_url(url: str) -> str:
    """`http://host:port` of a server URL given with or without a trailing `/` or `/v1`."""
    url = url.strip().rstrip("/")
    check(url.startswith(("http://", "https://")), f"answers server {url!r} is not an http(s) URL")
    return url[:-3] if url.endswith("/v1") else url


class Server:
    """One OpenAI-compatible server at `url`: JSON requests with the standard library (no SDK), an
    `OPENAI_API_KEY` from the environment sent as a bearer token when set."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        self.url, self.timeout = normalize_url(url), timeout
        self.model: str | None = None
        self.prompt_ids = True               # whether the prompt goes as token ids (decided by `check_server`)
        self.end_of_turn: int | None = None
        self.stop_text: str | None = None
        self.decode: Callable[[list[int]], str] | None = None

    def call(self, path: str, body: Mapping | None = None, timeout: float | None = None) -> Any:
        """The JSON answer of GET (no body) or POST `path`. Raises `Transient` for what may pass
        (no connection, timeouts, 5xx/408/429), `urllib.error.HTTPError` for another status."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if os.environ.get("OPENAI_API_KEY"):
            headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            if error.code in TRANSIENT_HTTP:
                raise Transient(f"HTTP {error.code} from {path}") from error
            raise
        except (urllib.error.URLError, OSError) as error:         # refused, reset, timed out, cut mid-body
            raise Transient(f"{type(error).__name__}: {getattr(error, 'reason', error)}") from error
        try:
            return json.loads(raw)
        except ValueError as error:
            raise Transient(f"{path} answered {len(raw)} bytes that are not JSON") from error

    def complete(self, request: Request) -> Completion:
        """One try of `request` (module docstring); `Transient` when the answer is not a whole one."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": request.max_tokens,
                                "temperature": request.temperature, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                "seed": request.seed, "n": 1,
                                "stream": False, "return_token_ids": True}
        if self.end_of_turn is not None:
            body["stop_token_ids"] = [self.end_of_turn]
        if self.prompt_ids:
            body["prompt"] = request.ids
        else:
            body.update(prompt=request.text, add_special_tokens=False)
        try:
            answer = self.call("/v1/completions", body)
        except urllib.error.HTTPError as error:
            raise SpecdecError(f"the answers server {self.url} refused a completion ({request.where}): HTTP "
                               f"{error.code} {_reason(error)}") from error
        return self._completion(answer, request)

    def _completion(self, answer: Any, request: Request) -> Completion:
        choices = answer.get("choices") if isinstance(answer, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if choice is None or not isinstance(choice.get("text"), str):
            raise Transient("an answer with no text")
        reason, text = choice.get("finish_reason"), choice["text"]
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        ids = choice.get("token_ids")
        if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids) and self.decode is not None:
            if ids[-1] == self.end_of_turn:
                ids = ids[:-1]
            text = self.decode(ids)
        tokens = usage.get("completion_tokens")
        if reason not in ("stop", "length"):
            raise Transient(f"a cut answer (finish_reason {reason!r})")
        if reason == "length" and (not text or (isinstance(tokens, int) and tokens < request.max_tokens)):
            raise Transient(f"an empty or cut answer ({tokens} of {request.max_tokens} tokens, {len(text)} characters, "
                            "finish_reason 'length')")
        if self.stop_text and text.endswith(self.stop_text):
            text = text[:-len(self.stop_text)]
        if not isinstance(tokens, int):
            tokens = len(ids) if isinstance(ids, list) else max(1, len(text) // 4)
        return Completion(text, reason == "stop", int(tokens))


def _reason(error: urllib.error.HTTPError) -> str:
    try:
        detail = error.read(300).decode("utf-8", "replace")
    except OSError:
        detail = ""
    return " ".join(detail.split())[:200]


@dataclass
class ServerInfo:
    """A checked server: `server` (ready to complete), its identity (`identity`: the /v1/models
    entry and what the server reports of itself), the context it holds (`context`, None when not
    reported), whether its tokenizer was compared (`tokenizer`: "same" or "not compared: no /tokenize")
    and the weights' verdict (`weights`: "same" or "quantized") with the greedy tokens that agreed
    per probe (`agreed`, of `probe_tokens`)."""
    server: Server
    identity: dict
    context: int | None
    tokenizer: str
    weights: str
    agreed: list[int]
    probe_tokens: list[int]

    def describe(self) -> dict[str, Any]:
        """What the answers file records of this server."""
        return {"url": self.server.url, "model": self.server.model, **self.identity, "context": self.context,
                "prompt": "token ids" if self.server.prompt_ids else "text", "tokenizer": self.tokenizer,
                "weights": self.weights, "greedy_agreed": self.agreed, "greedy_tokens": self.probe_tokens}


def _scalars(d: Any, most: int = 200) -> dict[str, Any]:
    """The short scalar fields of a JSON object (a server's self-report, without its chat template)."""
    if not isinstance(d, dict):
        return {}
    return {k: v for k, v in d.items() if isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= most)}


def _identity(server: Server) -> tuple[dict[str, Any], int | None]:
    """The server's model list entry and self-report, and its context per request when it says."""
    where = f"answers server {server.url}"
    try:
        models = server.call("/v1/models", timeout=30)
    except Transient as error:
        raise SpecdecError(f"{where} does not answer ({error}): start it, or check the URL") from None
    except urllib.error.HTTPError as error:
        raise SpecdecError(f"{where} is not an OpenAI-compatible server: GET /v1/models gave HTTP {error.code}") \
            from None
    data = models.get("data") if isinstance(models, dict) else None
    check(isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("id"),
          f"{where} is not an OpenAI-compatible server: GET /v1/models is not a list of models")
    check(len(data) == 1, f"{where} serves {len(data)} models ({', '.join(str(m.get('id')) for m in data[:4])}); "
                          "serve the target alone")
    entry = data[0]
    server.model = str(entry["id"])
    identity = {"models_entry": _scalars(entry), "meta": _scalars(entry.get("meta"))}
    context = entry.get("max_model_len") or entry.get("context_length")
    for path in ("/props", "/version", "/get_model_info"):   # llama.cpp, vLLM, SGLang
        try:
            report = server.call(path, timeout=10)
        except (Transient, urllib.error.HTTPError):
            continue
        if isinstance(report, dict):
            identity[path.strip("/")] = _scalars(report)
            settings = report.get("default_generation_settings")
            if isinstance(settings, dict) and isinstance(settings.get("n_ctx"), int):
                context = settings["n_ctx"]                   # llama.cpp: the context of one slot
    return identity, int(context) if isinstance(context, int) else None


def _tokenizer_verdict(server: Server, reference: Reference) -> str:
    """'same', or 'not compared: no /tokenize'; SpecdecError when the server's ids differ."""
    body = {"content": TOKENIZE_TEXT, "prompt": TOKENIZE_TEXT, "add_special": False, "add_special_tokens": False,
            "model": server.model}
    answer = None
    for path in ("/tokenize", "/v1/tokenize"):
        try:
            answer = server.call(path, body, timeout=30)
            break
        except (Transient, urllib.error.HTTPError):
            continue
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list):
        return "not compared: no /tokenize"
    tokens = [t["id"] if isinstance(t, dict) else t for t in tokens]
    mine = list(reference.tokenizer(TOKENIZE_TEXT, add_special_tokens=False)["input_ids"])
    first = next((i for i, (a, b) in enumerate(zip(tokens, mine, strict=False)) if a != b), min(len(tokens), len(mine)))
    check(tokens == mine, f"answers server {server.url} ({server.model}) serves another tokenizer than the target: "
                          f"a probe text is {len(tokens)} tokens there and {len(mine)} here, first different at "
                          f"token {first}; serve the target's own weights and tokenizer")
    return "same"


def _probe(server: Server, reference: Reference, ids: list[int], text: str) -> Completion:
    request = Request(ids, text, PROBE_TOKENS, 0.0, 0, "a probe")
    try:
        return server.complete(request)
    except SpecdecError:
        if not server.prompt_ids:
            raise
        server.prompt_ids = False                     # no token-id prompts here: send the rendered text
        return server.complete(request)


def _agreed(reference: Reference, mine: list[int], theirs: str) -> int:
    """How many of the target's greedy tokens `mine` the server's text `theirs` starts with."""
    tokenizer = reference.tokenizer
    n = 0
    while n < len(mine) and theirs.startswith(tokenizer.decode(mine[:n + 1], skip_special_tokens=True)):
        n += 1
    return n


def check_reachable(urls: Sequence[str]) -> None:
    """Each URL answers GET /v1/models with one model (`_identity`); one line on the first that
    does not. Cheap, and needs no target: callers run it before loading one."""
    for url in urls:
        _identity(Server(url, timeout=30))


def check_server(url: str, reference: Reference, seq_len: int, retry: Retry = Retry()) -> ServerInfo:
    """The server at `url`, checked (module docstring) and ready to answer; SpecdecError, one line,
    for a URL that does not answer, is not OpenAI-compatible, holds fewer than seq_len + 1 tokens
    per request, or serves another tokenizer or other weights."""
    server = Server(url, retry.timeout)
    tokenizer = reference.tokenizer
    server.end_of_turn = reference.end_of_turn
    server.stop_text = tokenizer.convert_ids_to_tokens(reference.end_of_turn)
    server.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    identity, context = _identity(server)
    check(context is None or context >= seq_len + 1,
          f"answers server {server.url} holds {context} tokens per request; the rows need seq_len + 1 = {seq_len + 1}: "
          "start it with a longer context (vLLM --max-model-len, SGLang --context-length, llama-server -c "
          "n x --parallel n)")
    verdict = _tokenizer_verdict(server, reference)
    agreed, sizes, same = [], [], True
    for prompt in PROBES:
        turns = (Turn("user", prompt),)
        ids = context_ids(tokenizer, turns, reference.chat_template_kwargs)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        mine = reference.greedy(ids, PROBE_TOKENS)
        mine = mine[:-1] if mine and mine[-1] == reference.end_of_turn else mine
        theirs = _probe_text(server, reference, ids, text, retry)
        agreed.append(_agreed(reference, mine, theirs))
        sizes.append(len(mine))
        same = same and theirs == tokenizer.decode(mine, skip_special_tokens=True)
    close = all(a >= min(PROBE_AGREE, n) for a, n in zip(agreed, sizes, strict=True))
    check(close, f"answers server {server.url} ({server.model}) serves other weights than the target: its greedy "
                 f"answers to {len(PROBES)} probe prompts agree with the target's on {agreed} of {sizes} tokens (a "
                 f"quantized copy agrees on at least the first {PROBE_AGREE} of each); serve the target")
    return ServerInfo(server, identity, context, verdict, "same" if same else "quantized", agreed, sizes)


def _probe_text(server: Server, reference: Reference, ids: list[int], text: str, retry: Retry) -> str:
    delay = retry.backoff
    for attempt in range(retry.attempts):
        try:
            return _probe(server, reference, ids, text).text
        except Transient as error:
            if attempt + 1 == retry.attempts:
                raise SpecdecError(f"answers server {server.url} did not answer a probe completion in "
                                   f"{retry.attempts} tries ({error})") from None
        time.sleep(delay)
        delay = min(delay * retry.factor, retry.most)
    raise AssertionError("unreachable")


class Stopped(Exception):
    """The pool was stopped (another request failed, or the time budget ran out)."""


class ServerPool:
    """Requests fanned out over every checked server, at most `in_flight` on each (module
    docstring). `complete(request)` blocks until a slot is free; `stop()` makes waiting and later
    requests raise `Stopped`."""

    def __init__(self, servers: Sequence[ServerInfo], in_flight: int, retry: Retry = Retry()) -> None:
        check(len(servers) > 0, "no answers server")
        check(isinstance(in_flight, int) and in_flight >= 1, f"in_flight must be >= 1, got {in_flight!r}")
        self.servers, self.in_flight, self.retry = [s.server for s in servers], in_flight, retry
        self._free: queue.Queue[Server] = queue.Queue()
        for _ in range(in_flight):
            for s in self.servers:
                self._free.put(s)
        self._failures = {s.url: 0 for s in self.servers}
        self._down: set[str] = set()
        self._lock = threading.Lock()
        self.stopped = threading.Event()

    @property
    def slots(self) -> int:
        return self.in_flight * len(self.servers)

    def stop(self) -> None:
        self.stopped.set()

    def _take(self) -> Server:
        while True:
            if self.stopped.is_set():
                raise Stopped
            with self._lock:
                if len(self._down) == len(self.servers):
                    raise SpecdecError(f"every answers server stopped answering ({', '.join(sorted(self._down))})")
            try:
                server = self._free.get(timeout=0.2)
            except queue.Empty:
                continue
            if server.url not in self._down:
                return server

    def _give(self, server: Server, failed: bool) -> None:
        with self._lock:
            self._failures[server.url] = self._failures[server.url] + 1 if failed else 0
            if self._failures[server.url] >= self.retry.attempts:
                self._down.add(server.url)
            if server.url not in self._down:
                self._free.put(server)

    def complete(self, request: Request) -> Completion:
        """`request` answered by whichever server has a free slot, retried with backoff."""
        delay, last = self.retry.backoff, ""
        for _ in range(self.retry.attempts):
            server = self._take()
            try:
                result = server.complete(request)
            except Transient as error:
                last = f"{server.url}: {error}"
                self._give(server, True)
                if self.stopped.wait(delay):
                    raise Stopped from None
                delay = min(delay * self.retry.factor, self.retry.most)
                continue
            except BaseException:
                self._give(server, False)
                raise
            self._give(server, False)
            return result
        raise SpecdecError(f"{self.retry.attempts} tries of one completion ({request.where}) failed, the last with "
                           f"{last}")


def connect(urls: Sequence[str], reference: Reference, seq_len: int, in_flight: int,
            retry: Retry = Retry()) -> tuple[ServerPool, list[dict[str, Any]]]:
    """Every URL checked (`check_server`, in order: the first bad one is the error) and pooled;
    returns the pool and each server's `describe()` for the answers file."""
    check(len(urls) > 0, "--answers-server needs at least one URL")
    check(len(set(map(normalize_url, urls))) == len(urls), f"an answers server is given twice: {', '.join(urls)}")
    infos = [check_server(u, reference, seq_len, retry) for u in urls]
    return ServerPool(infos, in_flight, retry), [i.describe() for i in infos]


def hf_reference(model: Any, tokenizer: Any, end_of_turn: int, identity: Mapping[str, Any],
                 chat_template_kwargs: Mapping | None = None) -> Reference:
    """The `Reference` of a loaded Hugging Face target (`model` on its device): greedy tokens by
    `generate`, stopping at the end-of-turn token."""
    import torch

    def greedy(ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids], dtype=torch.long, device=model.device)
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                 eos_token_id=end_of_turn, pad_token_id=end_of_turn)
        return out[0, len(ids):].tolist()

    return Reference(tokenizer, int(end_of_turn), greedy, dict(chat_template_kwargs or {}), dict(identity))


def load_reference(target: str | os.PathLike, device: str = "cpu", dtype: Any = None,
                   chat_template_kwargs: Mapping | None = None) -> Reference:
    """The target (a model directory or GGUF file) loaded as the `Reference` servers are checked
    against, with its identity (`target_identity`, "kind": "hf")."""
    import torch

    from specdec_models.hf.weights import check_source, load_causal_lm, load_tokenizer, target_identity

    from .conversations import check_chat_template
    from .regenerate import stop_token

    path = check_source(target, "target")
    tokenizer = load_tokenizer(path, "target")
    check_chat_template(tokenizer, dict(chat_template_kwargs or {}))
    eot = stop_token(tokenizer, chat=True)
    check(eot is not None, f"the target {path} has no end-of-turn or EOS token: its answers would never stop")
    model = load_causal_lm(path, dtype=dtype or torch.float32, what="target").to(device)
    model.requires_grad_(False)
    identity = {"kind": "hf", **target_identity(model, path.resolve())}
    return hf_reference(model, tokenizer, eot, identity, chat_template_kwargs)


def wait_ready(url: str, seconds: float) -> bool:
    """Whether the server at `url` lists its models within `seconds` (a server still loading its
    weights answers 503, which is waited out)."""
    server = Server(url, timeout=5)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            models = server.call("/v1/models", timeout=5)
            if isinstance(models, dict) and models.get("data"):
                return True
        except (Transient, urllib.error.HTTPError):
            pass
        time.sleep(0.2)
    return False
