"""The training loop of an encoder and its head: schedule, accumulation, autocast,
validation with early stopping, checkpoints and exact resume.

Checkpoints (in the run folder while it trains): ``checkpoint.pt`` after every epoch (and
every ``checkpoint_every`` optimizer steps) holds the encoder, head, optimizer, scheduler
and grad-scaler states, torch's RNG states, the loop's counters and the epoch's batch
order; ``best.pt`` holds the weights of the best validation epoch. A resumed run restores
all of it and continues with the next batch, so on the CPU it ends with the same weights
as a run that was never interrupted.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.errors import ConfigError
from spar_bench.outputs import save_torch
from spar_bench.procs import check_stop

from ..stopwatch import Stopwatch, timed
from ..streams import device_batches
from ..train import deterministic, mean_loss, question_and_targets, to_device
from .config import FinetuneConfig, lr_factor
from .data import Loading, RowBatches, epoch_batches, items_of, remap
from .model import encode

CHECKPOINT, BEST = "checkpoint.pt", "best.pt"
#: batches between reads of the running loss for the progress bar (a read waits for the GPU)
POSTFIX_EVERY = 25


@dataclass
class Progress:
    """Counters of the loop (saved in every checkpoint)."""

    epoch: int = 0
    batch: int = 0  # batches of ``epoch`` already trained
    opt_steps: int = 0
    tr_sum: float = 0.0
    tr_n: int = 0
    best_val: float = math.inf
    best_epoch: int = -1
    hist_tr: list[float] = field(default_factory=list)
    hist_va: list[float] = field(default_factory=list)
    stopped: bool = False
    images: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Split:
    """Items of one role (train / val) and where their images are: (level, split) rows."""

    targets: Any
    level: str
    split: str


def project(head, tokens):
    """The token head's fixed PCA projection, differentiable (``TokenHead.preproject`` in torch)."""
    return ((tokens - head.proj_mean) @ head.proj_w) * head.proj_scale


class Encoding:
    """The encoder on its device with its autocast precision and its DataLoader settings
    (on CUDA: pinned memory, each next batch copied on a side stream, :mod:`..streams`)."""

    def __init__(self, enc, build, dev, comp: str, cfg: FinetuneConfig):
        import torch

        self.enc, self.build, self.dev, self.comp, self.cfg = enc, build, dev, comp, cfg
        self.amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(comp)
        workers = cfg.workers if cfg.workers is not None else (2 if dev.type == "cuda" else 0)
        self.loading = Loading(workers, dev.type == "cuda")

    def autocast(self):
        import torch

        return torch.autocast(self.dev.type, dtype=self.amp or torch.float32, enabled=self.amp is not None)

    def features(self, level: str, split: str, rows: np.ndarray, head=None, kind: str = "pooled"):
        """What a head reads, for sorted ``rows`` of a split: pooled ``(N, D)``, raw tokens
        (``head=None``, ``kind="tokens"``) or the head's projected tokens, float32 numpy."""
        import torch

        self.enc.module.eval()
        b = self.cfg.batch_size
        batches = [rows[s : s + b] for s in range(0, rows.size, b)]
        parts = []
        with torch.no_grad(), self.autocast():
            for _, images in device_batches(self.loading.loader(RowBatches(self.build, level, split, batches)),
                                            self.dev):
                check_stop()
                tokens, pooled = encode(self.enc, images, self.cfg.layer)
                if kind == "pooled":
                    f = pooled
                else:
                    f = tokens if head is None else project(head, tokens)
                parts.append(f.float().cpu().numpy())
        return np.concatenate(parts) if parts else np.zeros((0,), np.float32)


class Trainer:
    """Trains the encoder of ``encoding`` and ``head`` end to end."""

    def __init__(self, encoding: Encoding, head, kind: str, seed: int, run: Path, key: dict,
                 progress: bool = True):
        import torch

        cfg = encoding.cfg
        self.encoding, self.enc, self.head, self.kind = encoding, encoding.enc, head, kind
        self.cfg, self.seed, self.dev = cfg, int(seed), encoding.dev
        self.run, self.key, self.progress = Path(run), key, progress
        enc_params = [p for p in self.enc.module.parameters() if p.requires_grad]
        groups = [{"params": list(head.parameters()), "lr": cfg.head_lr}]
        #: encoder_lr 0: the encoder is frozen, kept in eval mode too (BatchNorm statistics and
        #: dropout as loaded), so only the head learns and the exported encoder is the loaded one
        self.frozen_encoder = not (enc_params and cfg.encoder_lr > 0)
        if not self.frozen_encoder:
            groups.insert(0, {"params": enc_params, "lr": cfg.encoder_lr})
        else:
            for p in enc_params:
                p.requires_grad_(False)
        self.opt = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
        self.scaler = torch.amp.GradScaler(self.dev.type, enabled=encoding.comp == "fp16")
        self.state = Progress()
        #: times the stages of :meth:`train_epoch` when set (bench/finetune.py); None: nothing is timed
        self.stopwatch: Stopwatch | None = None

    # ------------------------------------------------------------------ pieces
    def schedule(self, n_batches: int):
        import torch

        per_epoch = math.ceil(n_batches / self.cfg.accum)
        total = per_epoch * self.cfg.max_epochs
        warm = int(round(self.cfg.warmup_epochs * per_epoch))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, warm, total))

    def batch_loss(self, images, t, batch_rows: np.ndarray):
        """Loss of the items of ``t`` whose images are ``images`` (rows ``batch_rows``)."""
        import torch

        sw = self.stopwatch
        with timed(sw, "host prep"):
            idx, index = items_of(t, batch_rows)
            q, y = (to_device(self.dev, v) for v in question_and_targets(t, idx))
            index = torch.from_numpy(index).to(self.dev)
        with timed(sw, "forward"):
            with self.encoding.autocast():
                out = self.head_output(images, q, index)
            loss = t.spec.loss_value(out.float(), y, self.cfg.sinkhorn_iters)
        return loss, idx.size

    def head_output(self, images, q, index):
        tokens, pooled = encode(self.enc, images, self.cfg.layer)
        if self.kind == "pooled":
            return self.head(pooled[index], q)
        return self.head(project(self.head, tokens), q, index)

    def val_loss(self, va: Split) -> float:
        t = va.targets
        if len(t) == 0:
            return self.state.hist_tr[-1]
        rows = np.unique(t.rows)
        feats = self.encoding.features(va.level, va.split, rows, self.head, self.kind)
        return mean_loss(self.head, t.spec, feats, remap(t, rows), self.cfg.train_config())

    # ------------------------------------------------------------------ checkpoints
    def save(self, batches: list[np.ndarray]) -> None:
        import torch

        rng = {"torch": torch.get_rng_state()}
        if self.dev.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.dev)
        blob = {
            "key": self.key, "encoder": self.enc.module.state_dict(), "head": self.head.state_dict(),
            "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
            "scaler": self.scaler.state_dict(), "rng": rng, "progress": asdict(self.state),
            "order": [b.tolist() for b in batches],
        }
        _atomic_save(blob, self.run / CHECKPOINT)

    def restore(self) -> list[np.ndarray] | None:
        """Load ``checkpoint.pt`` when it exists (refused when it is of another run)."""
        import torch

        path = self.run / CHECKPOINT
        if not path.is_file():
            return None
        blob = load_saved(path, "checkpoint")
        if blob.get("key") != self.key:
            diff = sorted(k for k in set(self.key) | set(blob.get("key", {}))
                          if self.key.get(k) != blob.get("key", {}).get(k))
            raise ConfigError(f"{path}: a checkpoint of another run (differs in: {', '.join(diff)}); "
                              "rerun with the original arguments or pass --overwrite")
        self.enc.module.load_state_dict(blob["encoder"])
        self.head.load_state_dict(blob["head"])
        self.opt.load_state_dict(blob["optimizer"])
        self.sched.load_state_dict(blob["scheduler"])
        self.scaler.load_state_dict(blob["scaler"])
        torch.set_rng_state(blob["rng"]["torch"])
        if "cuda" in blob["rng"] and self.dev.type == "cuda":
            torch.cuda.set_rng_state(blob["rng"]["cuda"], self.dev)
        self.state = Progress(**blob["progress"])
        return [np.asarray(b, dtype=np.int64) for b in blob["order"]]

    def save_best(self) -> None:
        _atomic_save({"encoder": self.enc.module.state_dict(), "head": self.head.state_dict(),
                      "epoch": self.state.best_epoch, "val_loss": self.state.best_val}, self.run / BEST)

    def load_best(self) -> None:
        blob = load_saved(self.run / BEST, "best-epoch weights")
        self.enc.module.load_state_dict(blob["encoder"])
        self.head.load_state_dict(blob["head"])

    # ------------------------------------------------------------------ the loop
    def fit(self, tr: Split, va: Split, resume: bool) -> Progress:
        """Train until ``max_epochs`` or early stopping; the best epoch's weights are loaded."""
        import torch

        n_batches = len(epoch_batches(tr.targets.rows, self.cfg.batch_size, self.seed, 0))
        self.schedule(n_batches)
        devices = [self.dev] if self.dev.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), deterministic():
            torch.manual_seed(self.seed)
            batches = self.restore() if resume else None
            if batches is None:
                batches = epoch_batches(tr.targets.rows, self.cfg.batch_size, self.seed, 0)
            while not self.state.stopped and self.state.epoch < self.cfg.max_epochs:
                check_stop()
                self.train_epoch(tr, batches)
                self.end_epoch(va)
                batches = epoch_batches(tr.targets.rows, self.cfg.batch_size, self.seed, self.state.epoch)
                self.save(batches)
        self.load_best()
        return self.state

    def train_epoch(self, tr: Split, batches: list[np.ndarray]) -> None:
        """One epoch from ``state.batch`` on. The running training loss is summed on the device in
        float64 (the same additions, in the same order, as a Python float's), so no batch waits
        for the GPU to finish; it is read back only for a checkpoint, the progress bar (every
        :data:`POSTFIX_EVERY` batches) and the epoch's end."""
        import torch
        from tqdm.auto import tqdm

        st, cfg, sw = self.state, self.cfg, self.stopwatch
        acc = torch.tensor(st.tr_sum, dtype=torch.float64, device=self.dev)
        self.enc.module.train(not self.frozen_encoder)
        self.head.train()
        todo = batches[st.batch :]
        bar = tqdm(total=sum(b.size for b in todo), unit="img", leave=False, dynamic_ncols=True,
                   desc=f"epoch {st.epoch + 1}/{cfg.max_epochs}", disable=not self.progress)
        loader = self.encoding.loading.loader(RowBatches(self.encoding.build, tr.level, tr.split, todo,
                                                         timed=sw is not None))
        t0 = time.perf_counter()
        for got, images in device_batches(loader, self.dev, sw):  # CUDA: the next copy during this step
            check_stop()  # a swallowed SIGTERM: stop here, the checkpoint as the last save left it
            rows = batches[st.batch]
            if sw is not None:
                sw.add("read", got[2][0])
                sw.add("collate", got[2][1])
            loss, n = self.batch_loss(images, tr.targets, rows)
            with timed(sw, "backward"):
                self.scaler.scale(loss / cfg.accum).backward()
            st.batch += 1
            acc += loss.detach().double() * n
            st.tr_n += n
            st.images += int(rows.size)
            if st.batch % cfg.accum == 0 or st.batch == len(batches):
                with timed(sw, "step"):
                    self.step()
                if cfg.checkpoint_every and st.opt_steps % cfg.checkpoint_every == 0 and st.batch < len(batches):
                    st.tr_sum = float(acc)
                    self.save(batches)
            bar.update(int(rows.size))
            st.seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            if self.progress and (st.batch % POSTFIX_EVERY == 0 or st.batch == len(batches)):
                st.tr_sum = float(acc)
                bar.set_postfix_str(f"loss {st.tr_sum / max(st.tr_n, 1):.4f}, {st.images / max(st.seconds, 1e-9):.1f} img/s")
        st.tr_sum = float(acc)
        bar.close()

    def step(self) -> None:
        import torch

        params = [p for g in self.opt.param_groups for p in g["params"]]
        if self.cfg.grad_clip:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.state.opt_steps += 1

    def end_epoch(self, va: Split) -> None:
        st = self.state
        st.hist_tr.append(st.tr_sum / max(st.tr_n, 1))
        vl = self.val_loss(va)
        st.hist_va.append(vl)
        if vl < st.best_val - 1e-6:
            st.best_val, st.best_epoch = vl, st.epoch
            self.save_best()
        elif st.epoch - st.best_epoch >= self.cfg.patience:
            st.stopped = True
        if self.progress:
            from tqdm.auto import tqdm

            tqdm.write(f"epoch {st.epoch + 1}: train {st.hist_tr[-1]:.4f}  val {vl:.4f}"
                       f"  ({st.images / max(st.seconds, 1e-9):.1f} img/s)")
        st.epoch += 1
        st.batch, st.tr_sum, st.tr_n = 0, 0.0, 0


def load_saved(path: Path, what: str, fix: str = "pass --overwrite to start the run over") -> dict:
    """A checkpoint file (or a run's ``head.pt``), or one line naming it when it is truncated or
    not one (a copy cut short, a full disk before the atomic writes): ``fix`` says what to do."""
    import torch

    try:
        blob = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises RuntimeError, pickle and zip errors, EOFError, ...
        raise ConfigError(f"{path}: unreadable {what} file ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); "
                          f"{fix}") from None  # fmt: skip
    if not isinstance(blob, dict):
        raise ConfigError(f"{path}: not a {what} file of spar-probe finetune; {fix}")
    return blob


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_torch(obj, tmp)
    tmp.replace(path)


def run_key(**parts: Any) -> dict:
    """The JSON-normalised identity of a run (a checkpoint of other parts is refused)."""
    return json.loads(json.dumps(parts, sort_keys=True, default=str))
