"""A training script that survives a killed rank: checkpoints every few steps, and resumes from the newest
complete one when torchrun restarts it (docs/guide/operators.md). ``--fail-at RANK STEP`` kills that rank at
that step in the first attempt (fault injection, as torchft's ``fail_at`` and Megatron's ``rank_killed``).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 --max-restarts 1 \\
        -m autopar.examples.resilient_train --tensor 2 1 1 --data 2 --ckpt /tmp/ckpt --fail-at 1 3

``--reference`` then trains a second model of the same grid from scratch without interruption, in the same
process, and reports how far the resumed run's final parameters are from it (``--out``: a JSON file).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
import torch.distributed.checkpoint as dcp

import autopar
from autopar.examples import zoo


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor", type=int, nargs=3, default=(1, 1, 1))
    parser.add_argument("--data", type=int, default=None)
    parser.add_argument("--pipeline", type=int, default=1)
    parser.add_argument("--schedule", default=None)
    parser.add_argument("--shard-optimizer", action="store_true")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--model", default="llama")
    parser.add_argument("--sgd", action="store_true", help="SGD with momentum instead of AdamW")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--ckpt", required=True, help="the checkpoints' root directory (shared by every rank)")
    parser.add_argument("--fail-at", type=int, nargs=2, metavar=("RANK", "STEP"), default=None)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=args.tensor, data=args.data, pipeline=args.pipeline,
                                  schedule=args.schedule, shard_optimizer=args.shard_optimizer,
                                  sequence_parallel=args.sequence_parallel, compile=args.compile):
        model = zoo.build_model(args.model)
    if args.sgd:
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, zoo.VOCAB, (8, 16), generator=g), torch.randint(0, zoo.VOCAB, (8, 16), generator=g)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace, start: int,
          ckpt: str | None, fail: tuple[int, int] | None) -> list[float]:
    losses = []
    for step in range(start, args.steps):
        if fail is not None and dist.get_rank() == fail[0] and step == fail[1]:
            os.kill(os.getpid(), signal.SIGKILL)  # (the injected fault: no cleanup, no message)
        x, y = batch(step)
        if args.pipeline > 1:
            loss = autopar.train_step(model, x, y, F.cross_entropy)
        else:
            logits = zoo.logits_of(model(x))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if ckpt is not None and (step + 1) % args.save_every == 0:
            msd, osd = get_state_dict(model, opt)
            autopar.save_checkpoint({"model": msd, "optim": osd}, ckpt, step, async_save=args.async_save)
    autopar.wait_for_checkpoint()
    return losses


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model, opt = build(args)
    start, latest = 0, autopar.latest_checkpoint(args.ckpt)
    if latest is not None:  # the usual order: loaded before the model's first call
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=latest)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(latest.name.removeprefix("step-")) + 1
    losses = train(model, opt, args, start, args.ckpt, tuple(args.fail_at) if args.fail_at and attempt == 0 else None)
    final = autopar.full_state_dict(model)
    out = {"attempt": attempt, "resumed_at": start, "losses": losses}
    if args.reference:
        ref_model, ref_opt = build(args)
        out["reference_losses"] = train(ref_model, ref_opt, args, 0, None, None)
        want = autopar.full_state_dict(ref_model)
        out["bitwise"] = all(torch.equal(final[k], want[k]) for k in want)
        out["max_abs_diff"] = max(float((final[k].float() - want[k].float()).abs().max()) for k in want)
        out["max_rel_diff"] = max(float((final[k].float() - want[k].float()).norm()  # (per tensor, over its norm)
                                        / want[k].float().norm().clamp_min(1e-30)) for k in want)
    if dist.get_rank() == 0:
        print(json.dumps(out))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
