"""SpindWorker: `--worker-cls spind_vllm.worker.SpindWorker`.

vLLM's GPU worker plus spind: after the model is loaded it opens this rank's spind.Session
(geometry from the vLLM config, policy from SPIND_* environment variables, the same seed on every
rank), and before every execute_model it runs the step boundary (spind_vllm._state.on_schedule:
slots, resets, refresh, and when TP > 1 the group's sync: rank 0's control, dense while a
rank has no spind session, a reset of every rank's sequences when one switched sessions). The batch itself is begun by
the indexer metadata builder's wrapper, inside execute_model.
"""
import logging
import os
import re

from vllm.v1.worker.gpu_worker import Worker

from . import _state

log = logging.getLogger("spind_vllm")


def session_options(env=None):
    """spind.Session keyword arguments from SPIND_* variables (defaults: spind's socket, bf16
    state, sparsity 0.5, exploration 0.05, alpha 0.3, seed 1, no probes, uniform budgets, the
    EMA on the layer's path: SPIND_DEFER_EMA=1 runs it beside the next layer instead)."""
    env = os.environ if env is None else env
    defer = env.get("SPIND_DEFER_EMA", "0")
    if defer not in ("0", "1"):
        raise ValueError(f"SPIND_DEFER_EMA must be 0 or 1, not {defer!r}")
    return dict(
        target=env.get("SPIND_TARGET", "unix:///run/spin/spind.sock"),
        state=env.get("SPIND_STATE", "bf16"),
        seed=int(env.get("SPIND_SEED", "1")),
        target_sparsity=float(env.get("SPIND_SPARSITY", "0.5")),
        exploration=float(env.get("SPIND_EXPLORATION", "0.05")),
        alpha=float(env.get("SPIND_ALPHA", "0.3")),
        probe_period=int(env.get("SPIND_PROBE_PERIOD", "0")),
        budget_mode=env.get("SPIND_BUDGET", "uniform"),
        defer_ema=defer == "1",
    )


def gpu_uuid(device, props=None):
    """The GPU's UUID as nvidia-smi and spind write it (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx),
    from torch's device properties (whose uuid prints with or without the GPU- prefix)."""
    if props is None:
        import torch
        props = torch.cuda.get_device_properties(device)
    raw = getattr(props, "uuid", None)
    if isinstance(raw, (bytes, bytearray)):
        digits = bytes(raw).hex()
    else:
        digits = str(raw or "").removeprefix("GPU-").replace("-", "").lower()
    if not re.fullmatch(r"[0-9a-f]{32}", digits):
        raise ValueError(f"device {device}: torch reports no GPU UUID (got {raw!r})")
    d = digits
    return f"GPU-{d[:8]}-{d[8:12]}-{d[12:16]}-{d[16:20]}-{d[20:]}"


def resolve_target(target, device, props=None):
    """SPIND_TARGET with {gpu_uuid} replaced by this worker's GPU's UUID: with one spind per GPU
    (the Helm chart), unix:///run/spin/{gpu_uuid}.sock is the link each spind makes to its
    socket, so every rank finds its own GPU's spind however its container numbers the GPUs."""
    if "{gpu_uuid}" not in target:
        return target
    return target.replace("{gpu_uuid}", gpu_uuid(device, props))


def model_key(model_config):
    """The served model as spind's model name (warm budgets are kept per model): the served
    name, else the model path, with every character outside A-Z a-z 0-9 . _ - replaced by '_'
    (at most 128, not starting with '.')."""
    names = getattr(model_config, "served_model_name", None)
    name = names[0] if isinstance(names, (list, tuple)) and names else names
    name = str(name or getattr(model_config, "model", "") or "")
    key = re.sub(r"[^A-Za-z0-9._-]", "_", name)[-128:].lstrip(".")
    return key


def open_session(vllm_config, device, rank, env=None):
    """Opens the rank's session and hands it to the plugin state; None when SPIND_DISABLE=1 or
    the model has no SPIN-capable indexer layer."""
    import spind
    env = os.environ if env is None else env
    st = _state.STATE
    if env.get("SPIND_DISABLE") == "1":
        log.info("spind_vllm: SPIND_DISABLE=1, every step is dense")
        return None
    model = vllm_config.model_config
    layers = getattr(model.hf_config, "num_hidden_layers", None)
    noted = [(layer, k) for layer, k in st.topk_layers if layer >= 0]
    if layers is None:
        layers = 1 + max((layer for layer, _ in noted), default=-1)
    noted = [(layer, k) for layer, k in noted if layer < layers]
    if not noted:
        log.info("spind_vllm: no DSA indexer layer in this model, spind stays off")
        return None
    topk = noted[0][1]
    block_size = int(env.get("SPIND_BLOCK_SIZE", "64"))  # the indexer cache's page size
    spec = getattr(vllm_config, "speculative_config", None)
    rows = 1 + (spec.num_speculative_tokens if spec else 0)
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    max_slots = -(-model.max_model_len // block_size) * block_size
    tp = vllm_config.parallel_config.tensor_parallel_size > 1
    # TP > 1: spind only proposes policy and budget changes; the group adopts rank 0's at a step
    # boundary (spind_vllm._state.sync_tp_group).
    options = session_options(env)
    options["target"] = resolve_target(options["target"], device)
    session = spind.Session(layers, max_slots, block_size=block_size, topk=topk,
                            max_sequences=max_seqs, max_rows=rows, device=device,
                            client_name=f"vllm-rank{rank}", engine_control=tp,
                            model=model_key(model), **options)
    tp_group = None
    if tp:
        from vllm.distributed.parallel_state import get_tp_group
        tp_group = get_tp_group()
    st.attach(session, layers=layers, rows=rows, block_size=block_size, topk=topk,
              max_seqs=max_seqs, tp_group=tp_group)
    log.info("spind_vllm: rank %d session: %d layers, %d slots, %d sequences, %d rows", rank,
             layers, max_slots, max_seqs, rows)
    return session


class SpindWorker(Worker):
    def load_model(self, *args, **kwargs):
        result = super().load_model(*args, **kwargs)
        try:
            open_session(self.vllm_config, self.device, self.rank)
        except Exception:  # noqa: BLE001 - fail open: vLLM serves dense without spind
            log.exception("spind_vllm: could not open a session; every step is dense")
        _state.STATE.runner = self.model_runner
        return result

    def sample_tokens(self, *args, **kwargs):
        # vLLM samples, then runs the MTP drafter, whose metadata builds (its own builder, the
        # draft layer) are not a step of the session: on_build leaves the target step alone.
        st = _state.STATE
        st.drafting = True
        try:
            return super().sample_tokens(*args, **kwargs)
        finally:
            st.drafting = False

    def execute_model(self, scheduler_output):
        st = _state.STATE
        st.runner = self.model_runner
        try:
            st.on_schedule(scheduler_output)
        except Exception:  # noqa: BLE001 - never block the engine on SPIN
            log.exception("spind_vllm: step prologue failed")
        st.spin_step, st.dense_reason = False, "step not begun"  # until the builder begins it
        st.in_step = True
        try:
            return super().execute_model(scheduler_output)
        finally:
            st.in_step = False
            st.step_pending = False
