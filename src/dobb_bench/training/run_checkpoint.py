"""A run's checkpoints: written atomically, loaded only when safe and from the same configuration.

Checkpoints are written to a temp file and renamed, so an interrupted write leaves the previous
checkpoint intact. Under FSDP the model/optimizer go through ``torch.distributed.checkpoint``
(``get_state_dict``/``set_state_dict``) into a folder that is renamed the same way. ``RunCheckpoints``
is the part of ``train.Run`` that does this (its attributes are ``Run``'s).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from dobb_bench.training.checkpoint_io import (COMPLETE, inject_fault, fqn_to_index, fsync_file, rng_state,
                                               set_rng_state, check_dcp_metadata, safe_load)

__all__ = ["CKPT_FILE", "CKPT_DIR", "RunCheckpoints"]

CKPT_FILE = "checkpoint.pt"
CKPT_DIR = "checkpoint_dcp"


class RunCheckpoints:
    """Saving and loading the state of a ``train.Run`` (model, optimizer, scheduler, step, RNG,
    curves and timings), with the run's ``fingerprint`` checked on load."""

    def _extra_state(self) -> dict:
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "rng": rng_state(),
                "train_losses": self.train_losses, "evals": self.evals, "acc": self.acc,
                "timing": [self.train_time, self.opt_time, self.opt_steps_timed, self.train_cpu],
                "diverged": self.diverged, "fingerprint": self.fingerprint()}

    def save_checkpoint(self) -> None:
        if self.out is None:
            return
        if self.env.mode == "fsdp":
            return self._save_dcp()
        if self.env.rank == 0:
            state = self._extra_state()
            state["model"] = self.inner.state_dict()
            state["optimizer"] = self.optimizer.state_dict()
            path = self.out / CKPT_FILE
            tmp = path.with_name(path.name + ".tmp")
            torch.save(state, tmp)
            fsync_file(tmp)
            os.replace(tmp, path)
        self.env.barrier()

    def _save_dcp(self) -> None:
        """Writes into ``checkpoint_dcp.tmp``, marks it complete, then renames it into place.

        A loader takes only a folder holding the ``COMPLETE`` marker (written by rank 0 after
        every rank's shards and the metadata are on disk), so a save killed at any point leaves
        the previous checkpoint as the one that loads.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        final, tmp, old = (self.out / CKPT_DIR, self.out / (CKPT_DIR + ".tmp"), self.out / (CKPT_DIR + ".old"))
        if self.env.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        self.env.barrier()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
        extras = [None] * self.env.world
        dist.all_gather_object(extras, self._extra_state())
        self._saves += 1
        inject_fault("save", self._saves, self.env.rank)
        if self.env.rank == 0:
            torch.save(extras, tmp / "extra.pt")
            fsync_file(tmp / "extra.pt")
            (tmp / COMPLETE).write_text(str(self.step))
            fsync_file(tmp / COMPLETE)
            if final.exists():
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        self.env.barrier()

    def _dcp_folder(self) -> Path | None:
        for folder in (self.out / CKPT_DIR, self.out / (CKPT_DIR + ".old")):
            if (folder / COMPLETE).exists():
                return folder
        return None

    def _checkpoint_exists(self) -> bool:
        if self.out is None:
            return False
        if self.env.mode == "fsdp":
            if self._dcp_folder() is not None:
                return True
            # checkpoint_dcp (or .old) without COMPLETE was never a whole checkpoint; restarting at
            # step 0 in silence would discard the run's progress without a word. (A .tmp folder
            # without it is an interrupted save, expected: the previous checkpoint is the one used.)
            torn = [f for f in (self.out / CKPT_DIR, self.out / (CKPT_DIR + ".old")) if f.exists()]
            if torn:
                raise ValueError(f"cannot resume from {torn[0]}: it has no {COMPLETE} marker (its save "
                                 "did not finish, or it was copied in part); delete it to start the run "
                                 "over, or rerun with --no-resume or another --out")
            return False
        return (self.out / CKPT_FILE).exists()

    def _materialize_optimizer_state(self) -> None:
        """Gives every parameter its optimizer state, as DCP's loader needs a complete template.

        ``get_state_dict`` initializes state with a zero-gradient, lr=0 step only when the state
        is entirely empty; an optimizer that creates some state eagerly (Dobb: its matrices) would
        leave the AdamW-group parameters without a template, and ``set_state_dict`` then fails.
        We run the same lr=0 step whenever any parameter lacks state; everything it touches is
        overwritten by the checkpoint right after.
        """
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]
        if all(p in self.optimizer.state and self.optimizer.state[p] for p in params):
            return
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def load_checkpoint(self) -> None:
        if self.env.mode == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict
            folder = self._dcp_folder()
            check_dcp_metadata(folder)
            extras = safe_load(folder / "extra.pt")
            self._materialize_optimizer_state()
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            sd = {"model": model_sd, "optimizer": optim_sd}
            dcp.load(sd, checkpoint_id=str(folder))
            set_model_state_dict(self.model, sd["model"])
            self.optimizer.load_state_dict(fqn_to_index(sd["optimizer"]))
            if len(extras) != self.env.world:
                raise ValueError(f"checkpoint in {self.out} was written by {len(extras)} processes, "
                                 f"not {self.env.world}")
            state = extras[self.env.rank]
        else:
            state = safe_load(self.out / CKPT_FILE, map_location=self.env.device)
        if state["fingerprint"] != self.fingerprint():
            diff = [k for k in state["fingerprint"] if state["fingerprint"][k] != self.fingerprint().get(k)]
            raise ValueError(f"checkpoint in {self.out} comes from a different configuration "
                             f"({', '.join(diff)} differ); use another --out or --no-resume")
        if self.env.mode != "fsdp":
            self.inner.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.train_losses, self.evals, self.acc = state["train_losses"], state["evals"], state["acc"]
        self.train_time, self.opt_time, self.opt_steps_timed, self.train_cpu = state["timing"]
        self.diverged = state["diverged"]
        set_rng_state(state["rng"])
