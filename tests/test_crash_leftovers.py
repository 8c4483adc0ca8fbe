"""kill -9 in the middle of a write: the export, a training checkpoint and the embeddings cache
keep their previous version whole, and the next write removes what the killed one left.

Each kill hits a forked child (`conftest.forked`) while it writes: at a chosen point (a patched
function in the child sends itself SIGKILL there), or at a random moment of a loop of writes."""

from __future__ import annotations

import os
import random
import signal

import pytest
import torch

from conftest import REPO, forked

import specdec_models.export.specdec as export_mod
from specdec_models import Decoder, ModelConfig, export_hash, load_export, save_export
from specdec_models.errors import SpecdecError
from specdec_models.files import staged_dir


def decoder(seed: int, dim: int = 32, depth: int = 2) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(ModelConfig(vocab_size=256, dim=dim, depth=depth, heads=2, dim_head=dim // 2,
                               max_seq_len=64)).eval()


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".tmp"))


# ---------------------------------------------------------------- the export

def _kill_mid_weights():
    real = export_mod.save_file

    def half_then_die(tensors, path, **kwargs):       # killed while the weights file is being written
        real(tensors, path, **kwargs)
        os.truncate(path, os.path.getsize(path) // 2)
        die()
    export_mod.save_file = half_then_die


def _kill_before_commit():
    real = os.replace

    def replace(src, dst):                  # weights renamed, config.json written but not committed
        if str(dst).endswith("config.json"):
            die()
        return real(src, dst)
    export_mod.os.replace = replace


@pytest.mark.parametrize("kill", [_kill_mid_weights, _kill_before_commit], ids=["mid-weights", "before-commit"])
def test_export_killed_mid_write_leaves_the_previous_export_and_no_temps_after_the_next_save(tmp_path, kill):
    old, new = decoder(0), decoder(1)
    save_export(tmp_path, old)
    child = forked(lambda: (kill(), save_export(tmp_path, new)))
    assert child.status == -signal.SIGKILL, child.output
    assert leftovers(tmp_path), "the kill should have left a temp behind"
    assert same_weights(load_export(tmp_path), old)
    export_hash(tmp_path, verify=True)
    save_export(tmp_path, new)
    weights = f"weights-{export_hash(tmp_path)[:16]}.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", weights]
    assert same_weights(load_export(tmp_path), new)


def test_export_killed_at_random_moments_stays_loadable(tmp_path):
    # a 25 MB decoder saved over and over; SIGKILL lands wherever the child is (seeded delays)
    models = [decoder(seed, dim=256, depth=8) for seed in range(2)]
    save_export(tmp_path, models[0])
    delays = random.Random(0).sample([0.3, 0.45, 0.6, 0.75, 0.9, 1.05], 4)

    def save_forever():
        for i in range(10**6):
            save_export(tmp_path, models[i % 2])

    for delay in delays:
        child = forked(save_forever, kill_after=delay)
        assert child.status == -signal.SIGKILL, child.output
        loaded = load_export(tmp_path)                # whichever was committed last, whole
        export_hash(tmp_path, verify=True)
        assert any(same_weights(loaded, m) for m in models)
    save_export(tmp_path, models[1])
    assert leftovers(tmp_path) == [] and len(list(tmp_path.iterdir())) == 2


# ---------------------------------------------------------------- training checkpoints

def test_checkpoint_killed_mid_write_keeps_the_previous_one(tmp_path):
    from train.checkpoints import AtomicCheckpointIO

    path = tmp_path / "checkpoints" / "last.ckpt"
    writer = AtomicCheckpointIO()
    writer.save_checkpoint({"global_step": 1, "w": torch.ones(1000)}, path)

    def kill_mid_save():
        real = torch.save

        def half_then_die(obj, f):
            real(obj, f)
            f.truncate(f.tell() // 2)
            f.flush()
            die()
        torch.save = half_then_die
        writer.save_checkpoint({"global_step": 2, "w": torch.zeros(1000)}, path)

    child = forked(kill_mid_save)
    assert child.status == -signal.SIGKILL, child.output
    assert len(leftovers(path.parent)) == 1
    assert torch.load(path, weights_only=True)["global_step"] == 1
    writer.save_checkpoint({"global_step": 3, "w": torch.zeros(1000)}, path)
    assert leftovers(path.parent) == [] and torch.load(path, weights_only=True)["global_step"] == 3
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------- the embeddings cache

def test_cache_build_killed_midway_keeps_its_finished_shards_and_resumes_to_the_same_cache(tmp_path,
                                                                                         tiny_decoder_export):
    from dataclasses import replace

    from train.data.embeddings_cache import BuildRun, CacheSettings, build_cache, check_cache, open_cache

    out, whole = tmp_path / "cache", tmp_path / "whole"
    # 12 windows, 4 per shard (a row: 65 tokens + 32 x 32 x 2 embedding bytes + offset = 2,121 bytes)
    args = dict(export=tiny_decoder_export, data=REPO / "README.md")
    settings = CacheSettings(seq_len=32, windows=12, batch_size=2, shard_size=4 * 2121)
    done = []

    def kill_in_the_third_shard(tokens: int) -> None:
        done.append(tokens)
        if sum(done) > 9 * 32:                      # shards 0 and 1 are written, shard 2 half
            die()

    child = forked(lambda: build_cache(out=out, **args, settings=settings,
                                       run=BuildRun(progress=kill_in_the_third_shard)))
    assert child.status == -signal.SIGKILL, child.output
    partial = tmp_path / "cache.partial"
    assert not out.exists() and sorted(p.name for p in (partial / "dataset").iterdir()
                                       if not p.name.startswith(".tmp")) == ["data-00000.arrow", "data-00001.arrow"]
    kept = {p.name: p.stat().st_mtime_ns for p in (partial / "dataset").glob("data-*.arrow")}
    computed, lines = [], []
    meta = build_cache(out=out, **args, settings=settings, run=BuildRun(progress=computed.append, report=lines.append))
    assert sum(computed) == 4 * 32 and any("2 of 3 shard(s) already written" in line for line in lines)
    assert {n: (out / "dataset" / n).stat().st_mtime_ns for n in kept} == kept       # not rewritten
    assert not partial.exists() and leftovers(tmp_path) == [] and leftovers(out / "dataset") == []
    check_cache(out)
    build_cache(out=whole, **args, settings=settings)    # an uninterrupted build writes the same rows
    resumed, uninterrupted = open_cache(out)[:], open_cache(whole)[:]
    assert resumed.equals(uninterrupted) and meta["windows"] == 12
    # a partial build of other settings is refused in one line, and overwritten on request
    child = forked(lambda: build_cache(out=tmp_path / "c2", **args, settings=settings,
                                       run=BuildRun(progress=lambda tokens: die())))
    with pytest.raises(SpecdecError, match="partial build with other settings \\(rows_per_shard, seq_len, windows"):
        build_cache(out=tmp_path / "c2", **args, settings=replace(settings, seq_len=16, windows=4))
    build_cache(out=tmp_path / "c2", **args, settings=replace(settings, seq_len=16, windows=4),
                run=BuildRun(overwrite=True))
    assert check_cache(tmp_path / "c2")["seq_len"] == 16 and not (tmp_path / "c2.partial").exists()


def test_a_crash_between_the_two_renames_gets_the_old_directory_back(tmp_path):
    target = tmp_path / "cache"
    target.mkdir()
    (target / "old.txt").write_text("old")
    # the state a kill leaves between "move the old one aside" and "move the new one in"
    target.rename(tmp_path / ".tmp-cache.old-999999999-0123abcd")
    (tmp_path / ".tmp-cache-999999999-89abcdef").mkdir()
    with pytest.raises(RuntimeError), staged_dir(target) as tmp:
        assert (target / "old.txt").read_text() == "old"             # restored before anything else
        raise RuntimeError("this build fails too")
    assert (target / "old.txt").read_text() == "old" and leftovers(tmp_path) == []
    with staged_dir(target) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"] and leftovers(tmp_path) == []


def test_temps_of_a_live_process_are_left_alone(tmp_path):
    from specdec_models.files import remove_stale_temps

    live = tmp_path / f".tmp-last.ckpt-{os.getppid()}-0123abcd"      # pytest's parent is running
    dead = tmp_path / ".tmp-last.ckpt-999999999-0123abcd"
    for path in (live, dead):
        path.write_bytes(b"x")
    assert remove_stale_temps(tmp_path) == [dead] and live.exists()
