"""dobb_bench.cost.shapes: GPT-2 presets against the published parameter counts, layer slices."""
import pytest

from dobb_bench.cost.shapes import gpt2_param_count, matrix_shapes, parse_layers

# Hugging Face GPT-2 checkpoints (tied head, biases, learned positions): the published sizes
PUBLISHED = {"small": 124_439_808, "medium": 354_823_168, "large": 774_030_080, "xl": 1_557_611_200}
WIDTH_LAYERS = {"small": (768, 12), "medium": (1024, 24), "large": (1280, 36), "xl": (1600, 48)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_match_published_gpt2_sizes(name):
    assert gpt2_param_count(name) == PUBLISHED[name]
    d, layers = WIDTH_LAYERS[name]
    shapes = matrix_shapes(name)
    assert len(shapes) == 6 * layers
    assert sum(m * n for _, (m, n) in shapes) == 12 * d * d * layers
    assert dict(matrix_shapes(name, "1")) == {"h0.q": (d, d), "h0.k": (d, d), "h0.v": (d, d), "h0.o": (d, d),
                                              "h0.fc": (4 * d, d), "h0.proj": (d, 4 * d)}
    fused = matrix_shapes(name, "1", fused_qkv=True)
    assert [s for _, s in fused] == [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]


def test_layer_slices():
    assert list(parse_layers(None, 12)) == list(range(12))
    assert list(parse_layers("3", 12)) == [0, 1, 2]
    assert list(parse_layers("10:", 12)) == [10, 11]
    assert [n for n, _ in matrix_shapes("xl", "47:48")][0] == "h47.q"
    for bad in ("0", "5:5", "0:13", "a:b", "-1:2"):
        with pytest.raises(ValueError, match="--layers"):
            parse_layers(bad, 12)
