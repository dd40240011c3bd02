"""The DeepSpeed adapter on the CPU (gloo): mok_plugin.deepspeed.MoE against DeepSpeed's MoE with
the same weights (no drop, no noise); the engine with ZeRO-1 and ZeRO-2 at EP = 1 and 2, with a
SwiGLU expert, a biased GeLU MLP and a module no family computes (losses against the stock layer,
two MoK runs bitwise equal, checkpoints both ways); the "mok" block's errors; apply/revert; the
random options. The other expert modules: test_deepspeed_experts.py."""

import os
import warnings

import pytest
import torch
from torch import nn

deepspeed = pytest.importorskip("deepspeed", reason="needs deepspeed (pip install -e .[deepspeed])")

from deepspeed.moe.layer import MoE as StockMoE  # noqa: E402

import mok_plugin.deepspeed as mds  # noqa: E402
from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.testing import assert_close, free_port, make_layer_inputs, run_ranks  # noqa: E402

pytestmark = pytest.mark.deepspeed
H, I, E = 16, 24, 4


def one_rank_world():
    """A one-rank gloo world for a test module; the variables torchrun would set are removed after,
    so that scripts the later tests start do not think they run under torchrun."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    torch.distributed.destroy_process_group()
    # DeepSpeed keeps its expert and data-parallel groups in module globals: drop them with the world,
    # so that the next module's deepspeed.initialize does not use groups of a destroyed world.
    release = getattr(deepspeed.utils.groups, "_release_process_group_references", None)
    if release is not None:
        release()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def ds_world():
    yield from one_rank_world()


def _layers(k: int, **kwargs):
    torch.manual_seed(0)
    stock = StockMoE(H, mds.SwiGLUExpert(H, I), num_experts=E, k=k, drop_tokens=False, use_rts=False,
                     top2_2nd_expert_sampling=False, **kwargs)  # fmt: skip
    with torch.no_grad():  # distinct experts (DeepSpeed starts them as copies of one)
        for p in stock.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    mok = mds.MoE(H, mds.SwiGLUExpert(H, I), num_experts=E, k=k, drop_tokens=False, use_rts=False,
                  top2_2nd_expert_sampling=False, **kwargs)  # fmt: skip
    mok.load_state_dict(stock.state_dict())
    return stock, mok


@pytest.mark.parametrize("k", [1, 3])
def test_matches_stock_layer(ds_world, k):
    stock, mok = _layers(k)
    x = make_layer_inputs(40, H, seed=1).view(4, 10, H)
    probe = make_layer_inputs(40, H, seed=2).view(4, 10, H)
    results = []
    for layer in (stock, mok):
        xi = x.clone().requires_grad_()
        out, l_aux, counts = layer(xi)
        ((out * probe).sum() + l_aux).backward()
        grads = {n: p.grad for n, p in layer.named_parameters()}
        results.append((out.detach(), l_aux.detach(), counts, xi.grad, grads))
    (want_out, want_aux, want_counts, want_dx, _), (out, aux, counts, dx, _) = results
    assert_close(out, want_out, torch.float32, "output")
    assert_close(aux, want_aux, torch.float32, "l_aux")
    assert torch.equal(counts.to(want_counts.dtype), want_counts)
    assert_close(dx, want_dx, torch.float32, "d_x")
    # Expert gradients under the stock names.
    mok_grads = {"mok.router.weight": mok.mok.router.weight.grad,
                 "mok.experts.gate_up_proj": mok.mok.experts.gate_up_proj.grad,
                 "mok.experts.down_proj": mok.mok.experts.down_proj.grad}  # fmt: skip
    stock_grads = {n: p.grad for n, p in stock.named_parameters()}
    assert_close(mok_grads["mok.router.weight"], stock_grads["deepspeed_moe.gate.wg.weight"], torch.float32, "router")
    for i in range(E):
        prefix = f"deepspeed_moe.experts.deepspeed_experts.{i}."
        gate_up = torch.cat([stock_grads[prefix + "gate_proj.weight"], stock_grads[prefix + "up_proj.weight"]])
        assert_close(mok_grads["mok.experts.gate_up_proj"][i], gate_up, torch.float32, f"gate_up {i}")
        assert_close(mok_grads["mok.experts.down_proj"][i], stock_grads[prefix + "down_proj.weight"], torch.float32,
                     f"down {i}")  # fmt: skip


def test_state_dict_keys_round_trip(ds_world):
    stock, mok = _layers(2)
    assert set(mok.state_dict()) == set(stock.state_dict())
    fresh = StockMoE(H, mds.SwiGLUExpert(H, I), num_experts=E, k=2)
    fresh.load_state_dict(mok.state_dict())
    for key, value in stock.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(noisy_gate_policy="Gaussian"), "noisy_gate_policy='Gaussian': DeepSpeed allows"),
        (dict(mok_config={"top_k": 2}, k=1), "mok.top_k=2"),
        # A mok_config sets MoK's knobs only: no shared experts or routing DeepSpeed did not ask for.
        (dict(mok_config={"num_shared_experts": 1}), r"mok\.num_shared_experts=1 \(the arguments give 0"),
        (dict(mok_config={"score_function": "sigmoid"}), r"mok\.score_function='sigmoid'.*may set only backend"),
        (dict(mok_config={"top_k": "x" * 100_000}), r"mok\.top_k='xxx.*\.\.\. \(100002 characters\)"),
    ],
)
def test_random_and_unsupported_options_are_errors(ds_world, kwargs, message):
    with pytest.raises(MoKConfigError, match=message):
        mds.MoE(H, mds.SwiGLUExpert(H, I), num_experts=E, **kwargs)


def test_tensor_parallelism_from_an_mpu_is_refused_by_name(ds_world, monkeypatch):
    """deepspeed.initialize(mpu=...) stores the mpu in deepspeed.utils.groups, then calls each MoE
    layer's set_deepspeed_parallelism: there MoK refuses a tensor-parallel size > 1."""
    import types

    layer = mds.MoE(H, mds.SwiGLUExpert(H, I), num_experts=E, k=1, drop_tokens=False)
    mpu = types.SimpleNamespace(get_tensor_model_parallel_world_size=lambda: 2)
    monkeypatch.setattr(deepspeed.utils.groups, "mpu", mpu)
    with pytest.raises(MoKConfigError, match="tensor-model-parallel size is 2"):
        layer.set_deepspeed_parallelism()
    mpu.get_tensor_model_parallel_world_size = lambda: 1
    layer.set_deepspeed_parallelism()  # TP 1 through an mpu: fine


def test_mok_config_may_repeat_the_dtype_as_a_torch_dtype(ds_world):
    expert = mds.SwiGLUExpert(H, I).to(torch.bfloat16)
    for dtype in (torch.bfloat16, "bfloat16"):
        layer = mds.MoE(H, expert, num_experts=E, k=1, drop_tokens=False, mok_config={"params_dtype": dtype})
        assert layer.mok_config.params_dtype == "bfloat16"


@pytest.mark.parametrize("k", [1, 2])
def test_random_options_are_deepspeeds_and_reproducible(ds_world, k):
    # DeepSpeed's defaults (use_rts, top2_2nd_expert_sampling) and its noisy gates: MoK's counter-based
    # draws (test_deepspeed_gating.py), so an eval forward repeats and two layers built alike agree.
    layers = []
    for _ in range(2):
        layer = mds.MoE(H, mds.SwiGLUExpert(H, I), num_experts=E, k=k, capacity_factor=0.5,
                        noisy_gate_policy="RSample" if k == 1 else "Jitter")  # fmt: skip
        layer.mok.routing_fn.layer = 0  # the stream's layer number (otherwise the build order)
        layers.append(layer)
    layers[1].load_state_dict(layers[0].state_dict())
    x = make_layer_inputs(40, H, seed=1)
    assert torch.equal(layers[0](x)[0], layers[1](x)[0])  # training forwards at step 0
    for layer in layers:
        layer.eval()
    assert torch.equal(layers[0](x)[0], layers[0](x)[0])


@pytest.mark.parametrize(
    "block, message",
    [
        ({"enabeld": True}, "mok.enabeld: unknown key"),
        ({"enabled": True, "backend": "cuda"}, "mok.backend='cuda'"),
        ({"enabled": True, "ep_capacity_factor": -1}, "mok.ep_capacity_factor=-1"),
        ({"enabled": True, "config": "/no/such.yaml"}, "mok.config='/no/such.yaml': no such file"),
    ],
)
def test_bad_mok_blocks_name_the_key(block, message):
    with pytest.raises(MoKConfigError, match=message):
        mds.read_mok_settings({"train_batch_size": 2, "mok": block}).knobs()


def test_apply_and_revert(ds_world):
    try:
        assert mds.apply({"mok": {"enabled": True, "backend": "reference"}}) is True
        assert mds.apply({"mok": {"enabled": True, "backend": "reference"}}) is True  # idempotent
        layer = StockMoE(H, mds.SwiGLUExpert(H, I), num_experts=E, k=2, drop_tokens=False)
        assert isinstance(layer, mds.MoE) and layer.mok.config.backend == "reference"
        assert mds.apply({"mok": {"enabled": False}}) is False
        assert type(StockMoE(H, mds.SwiGLUExpert(H, I), num_experts=E)) is StockMoE
    finally:
        mds.revert()
    mds.revert()  # idempotent
    assert type(StockMoE(H, mds.SwiGLUExpert(H, I), num_experts=E)) is StockMoE
    assert isinstance(mds.build_moe({"mok": {"enabled": True}}, hidden_size=H, expert=mds.SwiGLUExpert(H, I),
                                    num_experts=E, drop_tokens=False), mds.MoE)  # fmt: skip


# --- the engine: ZeRO-1 / ZeRO-2, EP = 1 / 2, two gloo processes ----------------------------------


class _ResidualBlock(nn.Module):
    """An expert no MoK family computes (a LayerNorm inside): it runs as itself."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(H), nn.Linear(H, H)

    def forward(self, x):
        return x + self.fc(torch.tanh(self.norm(x)))


ENGINE_EXPERTS = {
    "swiglu": lambda: mds.SwiGLUExpert(H, I),
    "gelu_mlp_biases": lambda: nn.Sequential(nn.Linear(H, I), nn.GELU(), nn.Linear(I, H)),
    "residual_block": _ResidualBlock,
}


class TinyMoEModel(nn.Module):
    def __init__(self, moe_cls, ep_size: int, expert: str = "swiglu"):
        super().__init__()
        self.proj = nn.Linear(H, H)
        # k = 3: DeepSpeed's top-k gate (test_deepspeed_models.py trains the top-2 gate with dropping).
        self.moe = moe_cls(H, ENGINE_EXPERTS[expert](), num_experts=E, ep_size=ep_size, k=3, drop_tokens=False,
                           use_rts=False, top2_2nd_expert_sampling=False)  # fmt: skip
        self.head = nn.Linear(H, 1)

    def forward(self, x):
        out, l_aux, _ = self.moe(torch.tanh(self.proj(x)))
        return self.head(out).pow(2).mean() + 0.01 * l_aux


def _ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "mok": {"enabled": True, "backend": "reference"}}  # fmt: skip


def _train(moe_cls, stage: int, ep_size: int, rank: int, init_state: dict | None, expert: str, steps: int = 3):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning of an expert that runs as itself
        model = TinyMoEModel(moe_cls, ep_size, expert)
    if init_state is not None:
        model.load_state_dict(init_state)
    engine, *_ = deepspeed.initialize(model=model, config=_ds_config(stage), model_parameters=model.parameters())
    losses = []
    for step in range(steps):
        x = make_layer_inputs(2 * 8, H, seed=100 * step + rank).view(2, 8, H)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return engine, losses


def _engine_worker(rank: int, world: int, port: int, stage: int, ep_size: int, expert: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    init = TinyMoEModel(StockMoE, ep_size, expert).state_dict()  # per rank: its local experts
    with torch.no_grad():  # random biases and norm weights, not the zeros and ones of their init
        init = {k: v + 0.1 * torch.randn_like(v) for k, v in init.items()}
    stock, stock_losses = _train(StockMoE, stage, ep_size, rank, init, expert)
    mok1, mok_losses = _train(mds.MoE, stage, ep_size, rank, init, expert)
    mok2, mok_losses2 = _train(mds.MoE, stage, ep_size, rank, init, expert)
    # Checkpoints: MoK -> MoK (with optimizer state), stock -> MoK (weights only).
    mok1.save_checkpoint(out, tag="mok")
    stock.save_checkpoint(out, tag="stock")
    restored, _ = _train(mds.MoE, stage, ep_size, rank, None, expert, steps=0)
    restored.load_checkpoint(out, tag="mok")
    from_stock, _ = _train(mds.MoE, stage, ep_size, rank, None, expert, steps=0)
    from_stock.load_checkpoint(out, tag="stock", load_optimizer_states=False, load_lr_scheduler_states=False)
    torch.save({"stock": stock_losses, "mok": mok_losses, "mok2": mok_losses2,
                "mok_weights": {k: v.clone() for k, v in mok1.module.state_dict().items()},
                "mok2_weights": mok2.module.state_dict(),
                "restored_weights": restored.module.state_dict(),
                "stock_weights": stock.module.state_dict(), "from_stock_weights": from_stock.module.state_dict()},
               f"{out}/rank{rank}.pt")  # fmt: skip


def test_engine_compile_trains_as_the_uncompiled_engine(ds_world):
    # DeepSpeed's engine.compile() (torch.compile of the whole model) with MoK inside: the same losses
    # step by step, with the token count changing every step (dynamo's dynamic shapes); the reference
    # backend's experts run eagerly between graphs (tests/test_compile_eager_parts.py).
    def losses(compiled: bool) -> list[float]:
        torch.manual_seed(0)
        model = TinyMoEModel(mds.MoE, 1)
        engine, *_ = deepspeed.initialize(model=model, config=_ds_config(1), model_parameters=model.parameters())
        if compiled:
            engine.compile(backend="aot_eager")
            assert engine.is_compiled
        out = []
        for step in range(3):
            loss = engine(make_layer_inputs(2 * (8 + step), H, seed=step, device=engine.device).view(2, 8 + step, H))
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    nvtx = deepspeed.utils.nvtx.enable_nvtx  # engine.compile turns DeepSpeed's NVTX ranges off, process-wide
    torch._dynamo.reset()
    try:
        assert losses(compiled=True) == losses(compiled=False)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # graphs around the eager experts
    finally:
        torch._dynamo.reset()
        deepspeed.utils.nvtx.enable_nvtx = nvtx


def test_the_engine_says_when_the_weights_change(ds_world, tmp_path):
    # MoK keeps its FP8 weight copies while `is_first_microbatch` is False (fp8/weight_copies.py);
    # DeepSpeed never sets it, so mok_plugin's deepspeed.initialize has the engine set it True after
    # each optimizer update and checkpoint load: two micro-batches a step share one set of copies.
    torch.manual_seed(0)
    model = TinyMoEModel(mds.MoE, 1)
    config = {**_ds_config(0), "gradient_accumulation_steps": 2}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    layer = model.moe.mok
    seen = []
    for micro_batch in range(4):
        assert layer.is_first_microbatch is (micro_batch % 2 == 0), micro_batch  # True: the weights changed
        loss = engine(make_layer_inputs(2 * 8, H, seed=micro_batch).view(2, 8, H))
        seen.append(layer.is_first_microbatch)
        engine.backward(loss)
        engine.step()  # an update on every second micro-batch (the accumulation boundary)
    assert seen == [False] * 4 and engine.global_steps == 2
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine(make_layer_inputs(2 * 8, H, seed=9).view(2, 8, H))
    assert layer.is_first_microbatch is False
    engine.load_checkpoint(str(tmp_path), tag="t")
    assert layer.is_first_microbatch is True


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "stage, ep_size, expert",
    [(1, 1, "swiglu"), (2, 2, "swiglu"), (2, 2, "gelu_mlp_biases"), (2, 2, "residual_block")],
)
def test_engine_zero_stages_and_expert_parallel(tmp_path, stage, ep_size, expert):
    run_ranks(_engine_worker, 2, args=(stage, ep_size, expert, str(tmp_path)))
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        # Same weights, same data, no drop, no noise: the losses agree with the stock layer.
        assert_close(torch.tensor(r["mok"]), torch.tensor(r["stock"]), torch.float32, f"losses rank {rank}")
        assert r["mok"] == r["mok2"]  # two MoK runs: bitwise losses and weights
        for key, value in r["mok_weights"].items():
            assert torch.equal(r["mok2_weights"][key], value), key
            assert torch.equal(r["restored_weights"][key], value), key
        for key, value in r["stock_weights"].items():
            assert torch.equal(r["from_stock_weights"][key], value), key


@pytest.mark.slow
def test_source_patch_on_a_copy_of_the_installed_package(tmp_path):
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shutil.copytree(Path(deepspeed.__file__).parent, tmp_path / "deepspeed")
    patches = [sys.executable, "scripts/patches.py"]
    for _ in range(2):  # idempotent
        assert subprocess.run([*patches, "apply", "deepspeed", "--target", str(tmp_path)], cwd=root).returncode == 0
    assert subprocess.run([*patches, "check", "deepspeed", "--target", str(tmp_path)], cwd=root).returncode == 0
    ds_config = tmp_path / "ds_config.json"
    ds_config.write_text(json.dumps({"train_batch_size": 2, "mok": {"enabled": True, "backend": "reference"}}))
    build = ("from deepspeed.moe.layer import MoE; from mok_plugin.deepspeed import SwiGLUExpert; "
             "layer = MoE(16, SwiGLUExpert(16, 24), num_experts=4, drop_tokens=False); "
             "print('LAYER=' + type(layer).__module__ + '.' + type(layer).__name__)")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}

    def built(extra_env):
        run = subprocess.run([sys.executable, "-c", build], cwd=root, capture_output=True, text=True,
                             env={**env, **extra_env}, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        return next(line for line in run.stdout.splitlines() if line.startswith("LAYER="))[len("LAYER=") :]

    assert built({"MOK_DEEPSPEED_CONFIG": str(ds_config)}) == "mok_plugin.deepspeed.layer.MoE"
    assert built({}) == "deepspeed.moe.layer.MoE"  # no active ds_config: stock
    assert subprocess.run([*patches, "revert", "deepspeed", "--target", str(tmp_path)], cwd=root).returncode == 0
    assert subprocess.run([*patches, "check", "deepspeed", "--target", str(tmp_path)], cwd=root).returncode == 1


def test_tools_keep_deepspeed_off_its_cpu_shared_memory_allreduce():
    """MoK's tools and tests start DeepSpeed worlds with gloo's all-reduce: DeepSpeed's CPU op compiles
    C++ and leaves a 69 MB /dev/shm buffer per rank and world (cpu_comm.py)."""
    from deepspeed.comm.torch import build_shm_op

    from mok_plugin.deepspeed.cpu_comm import skip_shared_memory_allreduce

    skip_shared_memory_allreduce()
    assert build_shm_op() is None
