"""Measurements of the CT encoder astra-ct on real CT (issue 43), written as one JSON file.

    python scripts/astra_measure.py --out runs/astra-measure.json [--data ../shared/data]
        [--scales 0.5,1.0] [--cache-dir runs/ct-foundation/cache]

1. Trained, not random: layer3 tokens of the full TotalSegmentator example CT (Merlin's own
   transform, :func:`~spar_bench.probes.encoders.astra.merlin_input`) labelled with the organ
   covering most of each token's cell (TotalSegmentator's PREDICTED labels, read by the source
   ``totalsegmentator-predicted``), classified by a cross-validated linear probe: astra-ct
   against the random-init copy, and the majority class.
2. What a smaller input costs: the same at each ``--scales`` (0.5: 112 x 112 x 80, 1.0: Merlin's
   224 x 224 x 160), CPU and wall seconds of one forward, and how the reduced grid's tokens agree
   with the full grid's (cosine of each full-grid token with the reduced map upsampled to it).
3. Rendered against real CT: pooled features (layer3 and layer4 averages) of the 20 WORD label
   maps rendered as pseudo-CT (the builder's renderer) and of three real CTs (the TotalSegmentator
   example and the two TCIA DICOM series of ``real-ct/crlm``, through the DICOM reader), all through
   Merlin's transform at the first scale: cosine similarities within and across the two groups.
   With ``--cache-dir``: the same on the Level 4 cubes of ``spar-bench run ct-foundation``'s caches
   (rendered WORD originals against the real TotalSegmentator cube).

The functions are imported by tests/test_astra.py.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

#: layer3's stride on Merlin's (Z, X, Y) grid
LAYER3_STRIDE = (8, 16, 16)
MIN_SHARE = 0.5  # a token is labelled with an organ covering at least this share of its cell


def ts_case(root: Path):
    """The TotalSegmentator example (canonical HU image, organ ids, spacing) via the project's source."""
    from spar_bench.builder.sources.ts_predicted import TotalSegmentatorPredictedSource

    src = TotalSegmentatorPredictedSource(root)
    return src.load(src.find()[0])


def dicom_ct(folder: Path) -> tuple[np.ndarray, tuple[float, float, float]]:
    """A DICOM series through the project's reader: canonical HU ``[z, row, col]`` and spacing."""
    from spar_bench.builder.frame import to_canonical
    from spar_bench.builder.readers import as_hu_int16, read_volume

    data, affine = read_volume(folder, case_id=folder.parent.name)
    canon, spacing, _ = to_canonical(as_hu_int16(data, case_id=folder.parent.name, path=folder), affine)
    return np.ascontiguousarray(canon), spacing


def network_input(canonical: np.ndarray, spacing, scale: float):
    from spar_bench.probes.encoders.astra import canonical_to_ras, merlin_input

    ras, sp = canonical_to_ras(canonical, spacing)
    return merlin_input(ras.astype(np.float32), sp, scale)


def token_labels(mask: np.ndarray, spacing, scale: float, n_labels: int = 17) -> np.ndarray:
    """``(Z', X', Y')`` organ id of each layer3 token (0: no organ covers ``MIN_SHARE`` of it)."""
    import torch
    import torch.nn.functional as F

    from spar_bench.probes.encoders.astra import canonical_to_ras, merlin_grid

    onehot = np.stack([(mask == i).astype(np.float32) for i in range(n_labels)])
    ras = np.stack([canonical_to_ras(c, spacing)[0] for c in onehot])
    sp = canonical_to_ras(onehot[0], spacing)[1]
    grid = merlin_grid(ras, sp, scale)  # (1, L, Z, X, Y); padding is 0 in every channel: unlabelled
    shares = F.avg_pool3d(grid, LAYER3_STRIDE, ceil_mode=True)[0]  # (L, Z', X', Y'): the network's ceil grid
    best, label = shares[1:].max(dim=0)
    return torch.where(best >= MIN_SHARE, label + 1, torch.zeros_like(label)).numpy()


def probe_accuracy(x: np.ndarray, y: np.ndarray, folds: int = 5, seed: int = 0, l2: float = 1e-2) -> float:
    """Cross-validated accuracy of a multinomial logistic regression (L-BFGS, L2) on standardised
    features; folds are a seeded permutation."""
    import torch

    classes, yi = np.unique(y, return_inverse=True)
    order = np.random.default_rng(seed).permutation(len(y))
    correct = 0
    for f in range(folds):
        test = order[f::folds]
        train = np.setdiff1d(order, test)
        mu, sd = x[train].mean(0), x[train].std(0) + 1e-6
        w, b = _fit_logistic(torch.tensor((x[train] - mu) / sd, dtype=torch.float64), torch.tensor(yi[train]),
                             len(classes), l2)
        with torch.no_grad():
            pred = (torch.tensor((x[test] - mu) / sd, dtype=torch.float64) @ w + b).argmax(1).numpy()
        correct += int((pred == yi[test]).sum())
    return correct / len(y)


def _fit_logistic(xt, target, n_classes: int, l2: float):
    """``(w, b)`` of an L2-regularised multinomial logistic regression, fitted by L-BFGS."""
    import torch

    w = torch.zeros(xt.shape[1], n_classes, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(xt @ w + b, target) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def layer_maps(enc, x, layers=(2, 3)) -> tuple[dict, float, float]:
    """``({layer: map (C, Z', X', Y') float32 numpy}, CPU s, wall s)`` of one network input."""
    import torch

    t_cpu, t_wall = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        maps = enc.network_maps(x, list(layers))
    cpu, wall = time.process_time() - t_cpu, time.perf_counter() - t_wall
    return {v: m[0].float().numpy() for v, m in maps.items()}, cpu, wall


def organ_separation(maps3: np.ndarray, labels: np.ndarray) -> dict:
    """Linear-probe accuracy of the labelled layer3 tokens, their count and the majority share."""
    keep = labels.reshape(-1) > 0
    x = maps3.reshape(maps3.shape[0], -1).T[keep]
    y = labels.reshape(-1)[keep]
    majority = float(np.bincount(y).max() / len(y)) if len(y) else float("nan")
    return {"tokens": int(len(y)), "organs": int(len(np.unique(y))), "majority": majority,
            "effective_rank": effective_rank(x.astype(np.float64)),
            "probe_accuracy": probe_accuracy(x, y) if len(np.unique(y)) > 1 else float("nan")}


def effective_rank(tokens: np.ndarray) -> float:
    """``exp`` of the entropy of the normalised singular values of centred tokens ``(N, D)``."""
    sv = np.linalg.svd(tokens - tokens.mean(0), compute_uv=False)
    p = sv / sv.sum()
    return float(np.exp(-(p[p > 0] * np.log(p[p > 0])).sum()))


def agreement(small: np.ndarray, full: np.ndarray) -> float:
    """Mean cosine, over the full grid's tokens, between full-size tokens and the reduced map upsampled."""
    import torch
    import torch.nn.functional as F

    up = F.interpolate(torch.from_numpy(small)[None], size=full.shape[1:], mode="trilinear", align_corners=False)[0]
    a, b = torch.from_numpy(full).flatten(1), up.flatten(1)
    return float(F.cosine_similarity(a, b, dim=0).mean())


def cosine_groups(rendered: np.ndarray, real: np.ndarray) -> dict:
    """Mean cosine similarity within the rendered set (pairs), within the real set, and across."""
    def norm(a):
        return a / np.linalg.norm(a, axis=1, keepdims=True)

    r, q = norm(rendered), norm(real)
    rr = r @ r.T
    qq = q @ q.T
    iu_r, iu_q = np.triu_indices(len(r), 1), np.triu_indices(len(q), 1)
    centre = rendered.mean(0)
    spread = np.median(np.linalg.norm(rendered - centre, axis=1))
    n = len(rendered)
    loo = [np.linalg.norm(rendered[i] - (centre * n - rendered[i]) / (n - 1)) / spread for i in range(n)]
    return {"rendered_vs_rendered": float(rr[iu_r].mean()),
            "real_vs_real": float(qq[iu_q].mean()) if len(q) > 1 else None,
            "rendered_vs_real": float((r @ q.T).mean()),
            # distance to the rendered set's centre over the rendered set's median distance to it:
            # each real CT, and each rendered one to the centre of the others (leave one out)
            "real_to_rendered_centre": (np.linalg.norm(real - centre, axis=1) / spread).round(2).tolist(),
            "rendered_to_others_centre_median_max": [round(float(np.median(loo)), 2), round(float(max(loo)), 2)]}


def rendered_word(word_root: Path, limit: int | None = None):
    """The WORD label maps rendered as pseudo-CT by the builder (``images: synthesize``)."""
    from spar_bench.builder.sources.word import WordSource

    src = WordSource(word_root, images="synthesize", seed=0)
    for ref in src.find()[:limit]:
        yield ref.case_id, src.load(ref)


def encoders():
    from spar_bench.probes.encoders import load_encoder

    return {"astra-ct": load_encoder("astra-ct"),
            "random-init": load_encoder("monai:resnet152-i3", random_init=True)}


def measure_real(data: Path, scales: list[float], encs: dict) -> dict:
    case = ts_case(data / "real-ct" / "ts-example")
    out: dict = {"labels": "TotalSegmentator's PREDICTED label map (seg_predicted.nii.gz), not a reference"}
    full_maps: dict = {}
    for scale in sorted(scales, reverse=True):
        x = network_input(case.image, case.spacing, scale)
        labels = token_labels(case.mask, case.spacing, scale)
        row = {"input_ZXY": list(x.shape[2:])}
        for name, enc in encs.items():
            maps, cpu, wall = layer_maps(enc, x)
            row[name] = {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "grid3": list(maps[2].shape[1:]),
                         **organ_separation(maps[2], labels)}
            if scale == max(scales):
                full_maps[name] = maps[2]
            else:
                row[name]["cosine_to_largest_scale_tokens"] = agreement(maps[2], full_maps[name])
        out[f"scale_{scale}"] = row
    return out


def pooled(enc, canonical, spacing, scale) -> np.ndarray:
    maps, _, _ = layer_maps(enc, network_input(canonical, spacing, scale))
    return np.concatenate([maps[2].mean(axis=(1, 2, 3)), maps[3].mean(axis=(1, 2, 3))])


def measure_rendered_vs_real(data: Path, scale: float, encs: dict, limit: int | None) -> dict:
    case = ts_case(data / "real-ct" / "ts-example")
    reals = {"ts-example": (case.image, case.spacing)}
    for d in sorted((data / "real-ct" / "crlm").glob("CRLM-*")):
        reals[d.name] = dicom_ct(d / "image")
    rendered = list(rendered_word(data / "word-labels", limit))
    out: dict = {"scale": scale, "real": sorted(reals), "rendered": [c for c, _ in rendered],
                 "feature": "layer3 average (1024) and layer4 average (2048), concatenated; and each alone"}
    for name, enc in encs.items():
        real = np.stack([pooled(enc, im, sp, scale) for im, sp in reals.values()])
        rend = np.stack([pooled(enc, c.image, c.spacing, scale) for _, c in rendered])
        out[name] = {"layer3": cosine_groups(rend[:, :1024], real[:, :1024]),
                     "layer4": cosine_groups(rend[:, 1024:], real[:, 1024:])}
    return out


def measure_cubes(cache_dir: Path) -> dict:
    """Rendered WORD cubes (originals) against the real TotalSegmentator cube, from the run's caches."""
    from spar_bench.probes.features import FeatureCache

    out = {}
    for enc in ("astra", "astra-random"):
        word = FeatureCache(cache_dir / f"{enc}@word.h5")
        ts = FeatureCache(cache_dir / f"{enc}@ts-predicted.h5")
        rend = np.concatenate([_originals(word, s) for s in word.splits("level4")])
        real = _originals(ts, "test")
        out[enc] = {"layer3_pooled": cosine_groups(rend, real), "n_rendered": int(len(rend))}
        word.close()
        ts.close()
    return out


def _originals(fc, split: str) -> np.ndarray:
    keys = [str(k) for k in fc.keys("level4", split)]
    pooled = np.asarray(fc.pooled("level4", split, 2), dtype=np.float64)
    return pooled[[i for i, k in enumerate(keys) if not k.endswith(("/mirror", "/flip"))]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--data", default="../shared/data")
    p.add_argument("--scales", default="0.5,1.0")
    p.add_argument("--limit", type=int, default=None, help="rendered WORD maps (default: all 20)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--skip", default="", help="comma list of real,rendered,cubes to skip")
    a = p.parse_args(argv)
    data, skip = Path(a.data), set(filter(None, a.skip.split(",")))
    scales = [float(s) for s in a.scales.split(",")]
    t0, c0 = time.perf_counter(), time.process_time()
    encs = encoders()
    result: dict = {"scales": scales}
    if "real" not in skip:
        result["organ_separation"] = measure_real(data, scales, encs)
    if "rendered" not in skip:
        result["rendered_vs_real"] = measure_rendered_vs_real(data, min(scales), encs, a.limit)
    if a.cache_dir and "cubes" not in skip:
        result["cubes"] = measure_cubes(Path(a.cache_dir))
    result["time"] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
