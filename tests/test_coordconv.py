"""``coord_channels``: a timm encoder whose first convolution reads pixel coordinates."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("timm")

from spar_bench.errors import ConfigError  # noqa: E402
from spar_bench.probes.encoders import load_encoder  # noqa: E402
from spar_bench.probes.encoders.coordconv import coord_input, first_conv  # noqa: E402
from spar_bench.probes.finetune.model import export_encoder  # noqa: E402

TINY = {"channels": [8, 8, 8, 8], "stem_width": 8, "output_stride": 8,
        "pretrained_cfg_overlay": {"input_size": [3, 32, 32]}}


def _enc(**extra):
    return load_encoder("timm:resnet10t", random_init=True, model_kwargs={**TINY, **extra})


def test_coord_input_replaces_channels_1_and_2():
    x = torch.full((2, 4, 3, 5), 7.0)
    y = coord_input(x)
    assert y.shape == x.shape
    assert torch.equal(y[:, 0], x[:, 0]) and torch.equal(y[:, 3], x[:, 3])
    assert torch.allclose(y[0, 1, 0], torch.linspace(-1, 1, 5)) and torch.allclose(y[0, 2, :, 0], torch.linspace(-1, 1, 3))


def test_coord_encoder_sees_position_and_round_trips(tmp_path):
    plain, coord = _enc(), _enc(coord_channels=True)
    sd_p, sd_c = plain.module.state_dict(), coord.module.state_dict()
    assert {k: v.shape for k, v in sd_p.items()} == {k: v.shape for k, v in sd_c.items()}
    assert all(torch.equal(sd_p[k], sd_c[k]) for k in sd_p)  # same seed, same weights
    img = torch.full((1, 224, 224), 100, dtype=torch.uint8)
    tp, tc = plain(img)[-1][0], coord(img)[-1][0]
    assert not torch.allclose(tp, tc)
    assert coord.spec.extra["model_args"]["coord_channels"] is True
    # the export carries the option: loaded back, the same tokens
    path = export_encoder(coord, tmp_path / "enc.safetensors",
                          {"encoder": "timm:resnet10t", "model_args": coord.spec.extra["model_args"]})
    again = load_encoder("timm:resnet10t", weights=str(path))
    assert torch.allclose(again(img)[-1][0], tc)


def test_coord_channels_need_a_conv():
    with pytest.raises(ConfigError, match="coord_channels"):
        first_conv(torch.nn.Linear(3, 3), "timm:x")
