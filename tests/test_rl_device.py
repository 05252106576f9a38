"""The Trainer's device side on CPU tensors: extraction on the device writes the host path's
bytes, FSDP2 shards as torch.chunk does, and a 2-process FSDP2 Trainer (gloo) publishes one
delta on every rank, the host encoder's bytes for its weights, and trains like one process."""

import copy
import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from aurora.delta import DeltaEncoder, apply_delta_torch, read_delta  # noqa: E402
from aurora.models import build_default  # noqa: E402
from aurora.rl import device as gpu  # noqa: E402
from aurora.rl.trainer import Group, GRPOConfig, Trainer, TrainerError  # noqa: E402

SPECIAL = np.array([0x0000, 0x8000, 0x7FC1, 0x7FC2, 0xFFFF], dtype=np.uint16)
"""+0, -0 and NaN payloads: different bits, equal or unordered as floats."""


def _states(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(old, new) bf16 bits of a layer with fused groups, at densities from none to all."""
    rng = np.random.default_rng(seed)
    shapes = {
        "model.embed_tokens.weight": (300, 64),
        "model.layers.0.self_attn.q_proj.weight": (128, 64),
        "model.layers.0.self_attn.k_proj.weight": (64, 64),
        "model.layers.0.self_attn.v_proj.weight": (64, 64),
        "model.layers.0.self_attn.o_proj.weight": (64, 128),
        "model.layers.0.mlp.gate_proj.weight": (256, 64),
        "model.layers.0.mlp.up_proj.weight": (256, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 256),
        "model.layers.0.input_layernorm.weight": (64,),
        "model.norm.weight": (64,),
    }
    density = [0.02, 0.3, 0.0, 0.01, 0.5, 0.001, 0.05, 1.0, 0.2, 0.0]
    old, new = {}, {}
    for (name, shape), d in zip(shapes.items(), density, strict=True):
        o = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        o.reshape(-1)[: SPECIAL.size] = SPECIAL
        n = o.copy()
        flat = n.reshape(-1)
        hit = rng.random(flat.size) < d
        flat[hit] = rng.integers(0, 1 << 16, size=int(hit.sum()), dtype=np.uint16)
        flat[: SPECIAL.size] = SPECIAL[::-1]  # -0 for +0, NaN payload for NaN payload
        old[name], new[name] = o, n
    return old, new


def _device_bytes(old, new, **kw):
    dev_old = {k: torch.from_numpy(v.view(np.int16).reshape(-1).copy()) for k, v in old.items()}
    dev_new = {k: torch.from_numpy(v.view(np.int16).reshape(-1).copy()) for k, v in new.items()}
    enc = gpu.DeviceDeltaEncoder(
        dev_old,
        lambda name: dev_new[name],
        {k: v.shape for k, v in old.items()},
        host_old=lambda name: old[name],
        **kw,
    )
    data = b"".join(s.data for s in enc.segments())
    return enc, data


@pytest.mark.parametrize("codec", ["aurora", "leb128", "dense"])
@pytest.mark.parametrize("fuse", [True, False])
def test_device_extraction_writes_the_host_encoders_bytes(codec, fuse):
    old, new = _states(1)
    kw = dict(model="m", version=4, base_hash="ab" * 32, codec=codec, fuse=fuse, segment_size=4096)
    want = b"".join(s.data for s in DeltaEncoder(old, new, **kw).segments())
    enc, got = _device_bytes(old, new, **kw)
    assert got == want
    assert {t.name for t in enc.tensors} == {
        t.name for t in read_delta(want).tensors
    }  # unchanged tensors (density 0) are left out by both
    assert len(want) > 3 * 4096  # cut into several segments


def test_device_extraction_counts_signed_zeros_and_nan_payloads_as_changes():
    old = {"w": np.array([0x0000, 0x7FC1, 0x3F80], dtype=np.uint16)}
    new = {"w": np.array([0x8000, 0x7FC2, 0x3F80], dtype=np.uint16)}
    enc, _ = _device_bytes(old, new, model="m", version=1, base_hash="00" * 32)
    assert [t.nnz for t in enc.tensors] == [2]


@pytest.mark.parametrize("rows,world", [(7, 2), (8, 4), (3, 4), (1, 2), (10, 3)])
def test_shard_rows_are_torch_chunks_split(rows, world):
    t = torch.arange(rows * 5).reshape(rows, 5)
    chunks = list(torch.chunk(t, world)) + [t[:0]] * world
    for r in range(world):
        got = gpu.shard_rows((rows, 5), r, world)
        flat = t.reshape(-1)[got.start : got.start + got.numel]
        assert torch.equal(flat, chunks[r].reshape(-1))
        assert got.total == rows * 5


# ------------------------------------------------------------------------------------------
# The Trainer on the device path, on CPU tensors
# ------------------------------------------------------------------------------------------


class _Sample:
    def __init__(self, ids, lp):
        self.token_ids, self.logprobs = ids, lp


def _parity(prompt, completion):
    return float(sum(map(ord, completion)) % 2)


def _groups(seed: int, version: int, count: int = 4, n: int = 4) -> list[Group]:
    """Completions of random tokens with behaviour log-probs near the model's (no sampling:
    the Trainer's arithmetic is what is under test)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(count):
        comps = []
        for _ in range(n):
            k = int(rng.integers(2, 8))
            comps.append(
                _Sample(rng.integers(3, 17, size=k).tolist(), (-rng.random(k) * 3).tolist())
            )
        out.append(Group(prompt=f"{g}+{seed}=", completions=comps, version=version))
    return out


def _trainer(**kw) -> Trainer:
    model, tok = build_default()
    return Trainer(model, tok, _parity, GRPOConfig(lr=3e-5), seed=0, **kw)


def test_a_trainer_extracting_on_the_device_publishes_the_host_paths_bytes_step_after_step():
    host, dev = _trainer(), _trainer(device_extract=True)
    assert not host.extract_on_device and dev.extract_on_device
    assert dev.weights_hash == host.weights_hash
    for step in range(2):
        for t in (host, dev):
            t.step(_groups(step, t.version))
        segs: list = []
        a, b = host.publish(), dev.publish(segs.append)
        assert b.data == a.data and b.weights_hash == a.weights_hash
        assert (b.changed, b.total) == (a.changed, a.total) and 0 < b.changed < b.total
        assert b"".join(s.data for s in segs) == b.data  # handed out as cut
        if step == 0:  # reading the published bits back changes nothing on the device side
            assert dev.published_digest() == host.published_digest()
    for k, v in host.published.items():
        assert np.array_equal(dev.published[k], v)


def test_a_delta_extracted_on_the_device_applies_by_index_into_bf16_parameters():
    dev = _trainer(device_extract=True)
    model, _ = build_default(dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    base = {k: v.detach().clone() for k, v in params.items()}
    dev.step(_groups(0, 0))
    pub = dev.publish()
    h = apply_delta_torch(read_delta(pub.data), params, active_version=0, active_hash=pub.base_hash)
    assert h == dev.weights_hash
    moved = 0
    for k, v in params.items():
        got = v.detach().view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(got, dev.published[k]), k
        moved += int((got != base[k].view(torch.int16).numpy().view(np.uint16)).sum())
    assert moved == pub.changed


def test_a_restored_device_trainer_produces_the_same_next_delta(tmp_path):
    a = _trainer(device_extract=True)
    a.step(_groups(0, 0))
    a.publish()
    a.save_checkpoint(tmp_path / "t.ckpt")
    b = _trainer(device_extract=True)
    b.load_checkpoint(tmp_path / "t.ckpt")
    for t in (a, b):
        t.step(_groups(1, t.version))
    assert a.publish().data == b.publish().data


def test_an_unsharded_trainer_cannot_be_told_to_extract_on_the_host_when_sharded():
    # outside a process group the switch is honoured both ways
    assert _trainer(device_extract=False).extract_on_device is False
    with pytest.raises(TrainerError, match="device_extract"):
        gpu_is = gpu.is_distributed
        gpu.is_distributed = lambda: True  # the check runs before any sharding
        try:
            _trainer(device_extract=False)
        finally:
            gpu.is_distributed = gpu_is


# ------------------------------------------------------------------------------------------
# FSDP2 over 2 processes (gloo, CPU)
# ------------------------------------------------------------------------------------------

STEPS = 2


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        t = _trainer()
        before = {k: v.copy() for k, v in t.published.items()}
        pubs, stats = [], []
        for step in range(STEPS):
            stats.append(t.step(_groups(step, t.version)))
            pubs.append(t.publish())
        after = {k: v.copy() for k, v in t.published.items()}
        master = {k: v.detach().full_tensor().clone() for k, v in t.params.items()}
        t.save_checkpoint(os.path.join(out, "fsdp.ckpt"))
        again = _trainer()  # a restarted sharded Trainer takes its shards of the checkpoint
        again.load_checkpoint(os.path.join(out, "fsdp.ckpt"))
        for x in (t, again):
            x.step(_groups(STEPS, x.version))
        resumed = t.publish().data == again.publish().data
        torch.save(
            {
                "sharded": t.sharded,
                "local": {k: r.numel for k, r in t._rows.items()},
                "data": [p.data for p in pubs],
                "hash": [p.weights_hash for p in pubs],
                "before": before,
                "after": after,
                "master": master if rank == 0 else None,
                "loss": [s.loss for s in stats],
                "grad_norm": [s.grad_norm for s in stats],
                "resumed": resumed,
            },
            os.path.join(out, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) is not in this torch")
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("fsdp")
    # spawn, not fork: a forked child of a process that ran torch hangs in gloo's set-up
    mp.spawn(_fsdp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return ranks, out


def test_fsdp2_ranks_hold_half_the_rows_and_publish_the_same_delta(fsdp_run):
    (r0, r1), _ = fsdp_run
    assert r0["sharded"] and r1["sharded"]
    whole = {k: v.size for k, v in r0["before"].items()}
    for k, n in whole.items():
        assert r0["local"][k] + r1["local"][k] == n
        assert r0["local"][k] == -(-r0["before"][k].shape[0] // 2) * (n // r0["before"][k].shape[0])
    assert r0["data"] == r1["data"] and r0["hash"] == r1["hash"]
    # restored from its (whole-state) checkpoint, a sharded Trainer writes the same next delta
    assert r0["resumed"] and r1["resumed"]


def test_fsdp2_deltas_are_the_host_encoders_bytes_for_the_gathered_weights(fsdp_run):
    (r0, _), _ = fsdp_run
    # the last step's delta is exactly the host path's extraction between the two states
    last = read_delta(r0["data"][-1])
    model, _ = build_default(dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, v in params.items():
            v.view(torch.int16).copy_(torch.from_numpy(r0["before"][k].view(np.int16)))
    h = None
    for v, data in enumerate(r0["data"]):
        d = read_delta(data)
        h = apply_delta_torch(d, params, active_version=v, active_hash=d.base_hash)
    assert h == r0["hash"][-1] == last.weights_hash
    for k, v in params.items():
        assert np.array_equal(v.detach().view(torch.int16).numpy().view(np.uint16), r0["after"][k])


def test_fsdp2_trains_like_one_process_up_to_summation_order(fsdp_run, tmp_path):
    (r0, _), out = fsdp_run
    one = _trainer()
    for step in range(STEPS):
        s = one.step(_groups(step, one.version))
        assert s.loss == pytest.approx(r0["loss"][step], rel=1e-5, abs=1e-7)
        assert s.grad_norm == pytest.approx(r0["grad_norm"][step], rel=1e-4)
        one.publish()
    for k, v in one.params.items():
        torch.testing.assert_close(r0["master"][k], v.detach(), rtol=1e-4, atol=1e-6)
    # published bf16 bits: identical but for elements that sit on a rounding boundary
    diff = sum(int((one.published[k] != r0["after"][k]).sum()) for k in r0["after"])
    total = sum(v.size for v in r0["after"].values())
    assert diff <= total // 10_000
    # a sharded checkpoint is the whole state: a single-process Trainer refuses it by name
    with pytest.raises(TrainerError, match="sharded"):
        copy.deepcopy(_trainer()).load_checkpoint(out / "fsdp.ckpt")


# ------------------------------------------------------------------------------------------
# The prepared GPU check, dry-run on the CPU
# ------------------------------------------------------------------------------------------


def test_the_gpu_check_dry_run_passes_every_part_it_can_run_on_the_cpu(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "s.json"
    args = ["--dry-run", "--prompts", "2", "--group", "3", "--scale", "64", "--max-layers", "2"]
    rc = mod.main([*args, "--memcpy-mb", "4", "--delta-mb", "0.01", "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    s = json.loads(out.read_text())
    chain = s["chain"]
    assert chain["actor"] == "_WorkerActor" and chain["v0_digest_equal"]
    assert [st["version"] for st in chain["steps"]] == [1, 2, 3, 4, 5]
    assert all(
        st["hash_equal"] and st["digest_equal"] and st["changed"] > 0 for st in chain["steps"]
    )
    assert s["apply"]["bit_exact"] and s["apply"]["layers"] == 2
    assert s["extract"]["bytes_equal_host"] and s["ok"]
    assert capsys.readouterr().out.rstrip().endswith("gpu_check: PASS")
