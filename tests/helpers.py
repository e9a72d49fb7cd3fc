"""Shared helpers of the tests (plain functions and classes; the fixtures are in conftest.py).

* fake source and builds: :class:`FakeSource`, :func:`make_case`, :func:`build_config`,
  :func:`tree_hashes`;
* the CLI and the shared phantom pipeline: :func:`run_cmd`, :func:`build_pipeline`
  (used by the session fixture ``pipeline``);
* tiny saved encoders: :data:`MAKERS` and the ``make_*`` functions, :func:`images`;
* checks: :func:`assert_mirror_consistent`; DICOM: :func:`write_dicom_series`;
* a stub OpenAI-compatible server: :func:`running_stub`.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from spar_bench.builder.case import Case, CaseRef
from spar_bench.builder.frame import voxel_spacing
from spar_bench.builder.schema import BILATERAL_PAIRS, LEVEL3_PROBES, ORGAN_ID, organ_index
from spar_bench.builder.sources.base import Source
from spar_bench.clitools import run_cli
from spar_bench.errors import CaseError

# -- a fake source and small builds ----------------------------------------------------
# the fake cases show 5 organs: below the default Level 1-2 floor (l12_min_organs, 8)
SMALL_SAMPLE = {"samples_per_case": 2, "l3_stride": 4, "l3_questions_per_probe": 2, "l12_min_organs": 1}


def make_case(case_id: str, split: str, seed: int) -> Case:
    """A 16-slice 48x48 'abdomen': body ellipse, liver right, spleen left, two kidneys."""
    rng = np.random.default_rng(seed)
    z, r, c = np.mgrid[0:16, 0:48, 0:48]
    body = ((r - 24) / 20.0) ** 2 + ((c - 24) / 22.0) ** 2 <= 1.0
    mask = np.zeros((16, 48, 48), np.uint8)
    jit = int(rng.integers(0, 3))

    def box(name, rows, cols, zs=(2, 14)):
        mask[zs[0]:zs[1], rows[0]:rows[1], cols[0] + jit:cols[1] + jit] = ORGAN_ID[name]

    box("liver", (10, 26), (6, 18))
    box("spleen", (14, 24), (32, 40))
    box("kidney_right", (28, 36), (12, 18), zs=(1, 10))
    box("kidney_left", (28, 36), (30, 36), zs=(1, 10))
    box("stomach", (10, 18), (24, 31), zs=(6, 15))
    image = np.where(body, 40, -1000).astype(np.int16)
    image[mask > 0] = 60 + 5 * mask[mask > 0]
    lesion = np.zeros_like(mask)
    lesion[5:7, 14:17, 10:13] = 1
    return Case(source="fake", case_id=case_id, split=split, mask=mask, image=image,
                lesion=lesion, spacing=(5.0, 6.0, 6.0), patient_id=f"p{case_id}",
                provenance={"files": {"mask": f"{case_id}.nii.gz"}, "sha256": {"mask": "0" * 64}})


class FakeSource(Source):
    """``root/cases.json`` lists ``[case_id, split]``; a case id containing 'bad' fails."""

    name = "fake"
    needs = "cases.json listing [case_id, split]"
    has_lesions = True

    def find(self) -> list[CaseRef]:
        listing = json.loads((self.root / "cases.json").read_text())
        return sorted((CaseRef("fake", cid, split, {"mask": self.root / f"{cid}.nii.gz"})
                       for cid, split in listing), key=lambda r: r.case_id)

    def load(self, ref: CaseRef) -> Case:
        if "bad" in ref.case_id:
            raise CaseError(ref.case_id, ref.files["mask"], "labels outside 0..16 (value 99)")
        return make_case(ref.case_id, ref.split, int(ref.case_id[-1]))

    def label_map(self) -> dict:
        return {"1": "liver"}


def build_config(root: Path, out: Path, **kw):
    from spar_bench.builder.build import BuildConfig

    base = dict(sources=("fake",), roots=(str(root),), out=str(out), sample=dict(SMALL_SAMPLE),
                seed=7, shard_size=5)
    base.update(kw)
    return BuildConfig(**base)


def tree_hashes(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


# -- the CLI and the shared phantom pipeline -------------------------------------------
def run_cmd(group, argv: list) -> int:
    """Run a click group as the console script does (exit status; errors as one line)."""
    return run_cli(group, [str(a) for a in argv])


def interrupted_cache(name: str, data, out: Path, opts) -> None:
    """``write_cache`` stopped (KeyboardInterrupt) after its second batch: a partial cache at ``out``."""
    import h5py

    from spar_bench.probes.cache import write_cache

    calls = []

    def stop(*_):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_cache(name, data, out, opts, progress=False, on_batch=stop)
    with h5py.File(out) as f:
        assert not f.attrs["complete"]


def build_pipeline(tmp_path_factory) -> dict[str, Path]:
    """Build (once per session, shared by test modules) phantom, shards and a dummy cache."""
    from spar_bench.builder.cli import cli as build_cli
    from spar_bench.probes.cli import cli as probe_cli

    root = tmp_path_factory.getbasetemp() / "spar-pipeline"
    paths = {
        "root": root,
        "shards": root / "shards",
        "cache": root / "cache" / "dummy.h5",
        "cache_noval": root / "cache" / "dummy-noval.h5",
        "other": root / "other-shards",
    }
    if (root / "done").is_file():
        return paths
    root.mkdir(parents=True, exist_ok=True)
    assert (
        run_cmd(build_cli, ["phantom", "--out", root / "ph", "--n", 10, "--layout", "canonical"]) == 0
    )
    assert (
        run_cmd(build_cli, ["--source", "phantom", "--root", root / "ph", "--out", paths["shards"],
                         "--samples-per-case", 3, "--counterfactual", "mirror", "--no-hf"])
        == 0
    )  # fmt: skip
    assert (
        run_cmd(build_cli, ["--source", "phantom", "--root", root / "ph", "--out", paths["other"],
                         "--levels", "level1", "--samples-per-case", 1, "--seed", 1, "--no-hf"])
        == 0
    )  # fmt: skip
    assert (
        run_cmd(
            probe_cli,
            ["cache", "--encoder", "dummy", "--data", paths["shards"], "--out", paths["cache"]],
        )
        == 0
    )
    assert (
        run_cmd(probe_cli, ["cache", "--encoder", "dummy", "--data", paths["shards"], "--out",
                         paths["cache_noval"], "--splits", "train,test", "--levels", "level3"])
        == 0
    )  # fmt: skip
    (root / "done").write_text("ok")
    return paths


# -- tiny saved encoders (no downloads) ------------------------------------------------
TINY_VIT = dict(depth=2, embed_dim=32, num_heads=2)


def images(n: int = 3, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, 224, 224), dtype=np.uint8))


def make_timm_vit(tmp: Path) -> tuple[str, dict]:
    import timm

    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, **TINY_VIT)
    path = tmp / "vit_tiny.pth"
    torch.save(m.state_dict(), path)
    return "timm:vit_tiny_patch16_224", {"weights": str(path), "model_kwargs": TINY_VIT}


def make_timm_resnet(tmp: Path) -> tuple[str, dict]:
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    m = timm.create_model("resnet10t", pretrained=False, num_classes=0)
    path = tmp / "resnet10t.safetensors"
    save_file(m.state_dict(), str(path))
    return "timm:resnet10t", {"weights": str(path)}


def make_hf_dinov2(tmp: Path) -> tuple[str, dict]:
    import transformers

    cfg = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, patch_size=14, image_size=224)
    torch.manual_seed(0)
    model = transformers.Dinov2Model(cfg)
    d = tmp / "tiny_dinov2"
    model.save_pretrained(d)
    proc = transformers.BitImageProcessor(
        size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112}, do_center_crop=True,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.25, 0.25, 0.25], resample=3)
    proc.save_pretrained(d)
    return f"hf:{d}", {}


#: vision towers of tiny open_clip models: a BiomedCLIP-style timm trunk and open_clip's own ViT.
OPEN_CLIP_TOWERS = {
    "timm-trunk": {"timm_model_name": "test_vit", "timm_model_pretrained": False, "timm_pool": "",
                   "timm_proj": "linear", "image_size": 160},
    "open_clip-vit": {"image_size": 64, "layers": 2, "width": 16, "head_width": 8, "patch_size": 16},
}


def make_open_clip(tmp: Path, vision_cfg: dict | None = None, folder: str = "tiny_clip") -> tuple[str, dict]:
    """A tiny open_clip model saved as a hub-style folder (default: a vit_tiny timm trunk, 224 px)."""
    import open_clip

    d = tmp / folder
    d.mkdir()
    cfg = {
        "model_cfg": {
            "embed_dim": 16,
            "vision_cfg": vision_cfg or {"timm_model_name": "vit_tiny_patch16_224", "timm_model_pretrained": False,
                                         "timm_pool": "", "timm_proj": "linear", "image_size": 224},
            "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1},
        },
        "preprocess_cfg": {"mean": [0.4, 0.4, 0.4], "std": [0.3, 0.3, 0.3], "interpolation": "bicubic"},
    }
    (d / "open_clip_config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = open_clip.create_model(f"local-dir:{d}")
    torch.save(model.state_dict(), d / "open_clip_pytorch_model.bin")
    return f"open_clip:local-dir:{d}", {}


def keep_trained_encoder(monkeypatch) -> dict:
    """``{"enc": ...}`` filled with the trained encoder (in memory) a finetune run exports."""
    from spar_bench.probes.finetune import model as run_mod

    kept: dict = {}
    export = run_mod.export_encoder

    def keep(enc, path, meta):
        kept["enc"] = enc
        return export(enc, path, meta)

    monkeypatch.setattr(run_mod, "export_encoder", keep)
    return kept


def make_torchscript(tmp: Path) -> tuple[str, dict]:
    class Tok(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, kernel_size=28, stride=28)

        def forward(self, x):
            t = self.conv(x).flatten(2).transpose(1, 2)
            return [t, torch.relu(t)]

    torch.manual_seed(0)
    path = tmp / "tok.pt"
    torch.jit.script(Tok()).save(str(path))
    (tmp / "tok.pt.json").write_text(json.dumps({"grid": [8, 8], "pooled": "avgpool"}))
    return f"torchscript:{path}", {}


MAKERS = {"dummy": lambda tmp: ("dummy", {}), "timm-vit": make_timm_vit,
          "timm-resnet": make_timm_resnet, "hf": make_hf_dinov2, "open_clip": make_open_clip,
          "torchscript": make_torchscript}


# -- mirror checks ---------------------------------------------------------------------
def assert_mirror_consistent(out: dict, x_tol: float = 1e-4) -> dict[str, int]:
    """Check every geometric consequence of the mirror; return counts of checked questions."""
    checked = {p: 0 for p in LEVEL3_PROBES}
    for level in ("level1", "level2"):
        rec = out[level]
        n = len(rec["key"]) // 2
        orig, mir = slice(0, n), slice(n, 2 * n)
        assert not rec["is_mirror"][orig].any() and rec["is_mirror"][mir].all()
        assert rec["origin_key"][mir].tolist() == rec["key"][orig].tolist()
        assert rec["key"][mir].tolist() == [k + "/mirror" for k in rec["key"][orig]]
        np.testing.assert_array_equal(rec["slice_index"][mir], rec["slice_index"][orig])
        np.testing.assert_array_equal(rec["seed"][mir], rec["seed"][orig])
        c0, c1 = rec["centroid"][orig].astype(np.float64), rec["centroid"][mir].astype(np.float64)
        np.testing.assert_allclose(c1[..., 0], (223.0 - 224.0 * c0[..., 0]) / 224.0, atol=x_tol)
        np.testing.assert_allclose(c1[..., 1], c0[..., 1], atol=1e-5)
    s = out["level3"]
    n_s = len(s["key"]) // 2
    assert s["origin_key"][n_s:].tolist() == s["key"][:n_s].tolist()
    # the mirrored slices are the flipped original slices (same field of view, mirrored)
    np.testing.assert_allclose(
        s["image"][n_s:].astype(int), s["image"][:n_s, :, ::-1].astype(int), atol=1
    )
    assert (s["label"][n_s:] == s["label"][:n_s, :, ::-1]).mean() > 0.999
    q = out["level3_questions"]
    n_q = len(q["q_key"]) // 2
    a, b = slice(0, n_q), slice(n_q, 2 * n_q)
    assert (q["q_slice"][b] == q["q_slice"][a] + n_s).all()
    assert q["q_key"][b].tolist() == [k.replace("/q", "/mirror/q") for k in q["q_key"][a]]
    np.testing.assert_array_equal(q["q_probe"][a], q["q_probe"][b])
    for i in range(n_q):
        j = n_q + i
        probe = LEVEL3_PROBES[q["q_probe"][i]]
        ans0, ans1 = int(q["q_answer"][i]), int(q["q_answer"][j])
        if probe == "symmetry":
            assert ans1 == 2 - ans0  # left_larger <-> right_larger, similar stays
            names = {
                organ_index(x): organ_index(y)
                for pair in BILATERAL_PAIRS
                for x, y in (pair, pair[::-1])
            }
            assert q["q_organ_a"][j] == names[int(q["q_organ_a"][i])]
            assert q["q_area_a_mm2"][j] == pytest.approx(q["q_area_b_mm2"][i])
        else:
            assert q["q_organ_a"][j] == q["q_organ_a"][i] and q["q_organ_b"][j] == q["q_organ_b"][i]
        if probe == "relative_position":
            assert ans1 == (1 - ans0 if q["q_axis"][i] == 0 else ans0)
        elif probe == "orientation":
            assert ans1 == (4 - ans0) % 8
        elif probe in ("size", "distance", "counting"):
            assert ans1 == ans0
            for name in ("q_area_a_mm2", "q_distance_mm"):
                np.testing.assert_allclose(q[name][j], q[name][i], rtol=1e-5)
            assert q["q_count"][j] == q["q_count"][i]
        checked[probe] += 1
    return checked


# -- DICOM series ----------------------------------------------------------------------
def write_dicom_series(folder: Path, data: np.ndarray, affine: np.ndarray) -> None:
    """Write data (i,j,k) with a RAS affine as an int16 DICOM series (one file per k)."""
    import SimpleITK as sitk

    folder.mkdir(parents=True)
    spacing = voxel_spacing(affine)
    lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine
    direction = lps[:3, :3] / np.asarray(spacing)
    img = sitk.GetImageFromArray(np.ascontiguousarray(data.transpose(2, 1, 0)).astype(np.int16))
    img.SetSpacing([float(s) for s in spacing])
    img.SetOrigin([float(v) for v in lps[:3, 3]])
    img.SetDirection([float(v) for v in direction.ravel()])
    writer = sitk.ImageFileWriter()
    writer.KeepOriginalImageUIDOn()
    series_uid = "1.2.826.0.1.3680043.2.1125.1"
    for k in range(img.GetDepth()):
        sl = img[:, :, k]
        pos = img.TransformIndexToPhysicalPoint((0, 0, k))
        for tag, value in (
            ("0020|000e", series_uid),
            ("0020|0013", str(k + 1)),
            ("0020|0032", "\\".join(f"{p:.6f}" for p in pos)),
            ("0020|0037", "\\".join(f"{v:.6f}" for v in (*direction[:, 0], *direction[:, 1]))),
            ("0008|0060", "CT"),
            ("0028|0030", f"{spacing[1]:.6f}\\{spacing[0]:.6f}"),
            ("0018|0050", f"{spacing[2]:.6f}"),
        ):
            sl.SetMetaData(tag, value)
        writer.SetFileName(str(folder / f"slice_{k:04d}.dcm"))
        writer.Execute(sl)


# -- a stub OpenAI-compatible server on 127.0.0.1 --------------------------------------
LIFETIME_S = 120.0


class Stub(ThreadingHTTPServer):
    """Answers from ``plan`` (then ``default``): ``text:T``, ``status:N``, ``retry:AFTER`` (429),
    ``refusal:T``, ``null`` (content null), ``malformed``, ``sleep:S``."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.plan: list[str] = []  # consumed one per request; then `default`
        self.default = "text:The correct answer is (B)."
        self.seen: list[dict] = []
        self.lock = threading.Lock()

    def next_action(self) -> str:
        with self.lock:
            return self.plan.pop(0) if self.plan else self.default


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv: Stub = self.server  # type: ignore[assignment]
        srv.seen.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
        action = srv.next_action()
        kind, _, arg = action.partition(":")
        if kind == "sleep":
            time.sleep(float(arg))
            kind, arg = "text", "A"
        if kind == "status":
            self._send(int(arg), b'{"error": "scripted"}')
        elif kind == "retry":  # 429 with a Retry-After header (seconds or an HTTP date)
            self._send(429, b'{"error": "busy"}', {"Retry-After": arg})
        elif kind == "refusal":  # the OpenAI refusal field, no content
            message = {"role": "assistant", "content": None, "refusal": arg}
            self._send(200, json.dumps({"choices": [{"index": 0, "message": message}]}).encode())
        elif kind == "null":  # content null, no refusal: an empty reply
            message = {"role": "assistant", "content": None}
            self._send(200, json.dumps({"choices": [{"index": 0, "message": message}]}).encode())
        elif kind == "malformed":
            self._send(200, b'{"choices": [ not json')
        else:
            reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": arg}}]}
            self._send(200, json.dumps(reply).encode())

    def _send(self, code: int, payload: bytes, headers: dict[str, str] | None = None):
        try:
            self.send_response(code)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out first
            pass


@contextmanager
def running_stub():
    """A started stub server; stopped on exit, and by itself after LIFETIME_S whatever happens."""
    srv = Stub()
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    killer = threading.Timer(LIFETIME_S, srv.shutdown)
    killer.daemon = True
    killer.start()
    try:
        yield srv
    finally:
        killer.cancel()
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)


def assert_at_blind(runs: list[dict], z: float = 2.5) -> None:
    """Heads that read no usable signal score as their blind controls do: over the runs'
    ``metrics.json`` (question probes), the items answered right beyond (or short of) the blind
    head, pooled, stay within ``z`` standard deviations of two independent binomial scores.

    Pooled rather than per run: one run's 16-32 test items move by several items between CPU
    kinds (trained models match bit for bit on one machine only), and a per-run interval test
    on them is either flaky or empty. A head that reads the image (say 90 % against a blind
    70 %) is far outside."""
    import math

    extra = var = 0.0
    for m in runs:
        n, acc, blind = m["n_items"]["test"], m["test"]["accuracy"], m["controls"]["blind"]["accuracy"]
        q = min(max(blind, 0.05), 0.95)
        extra += n * (acc - blind)
        var += 2 * n * q * (1 - q)
    assert abs(extra) <= z * math.sqrt(var) + 1, (extra, math.sqrt(var), [(m["probe"], m["test"]["accuracy"],
                                              m["controls"]["blind"]["accuracy"]) for m in runs])


def load_script(path: Path, name: str):
    """A script or bench file (not a package module) imported as module ``name``."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod
