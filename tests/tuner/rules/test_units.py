"""tuner.rules.units.gb: memory figures with the digits that tell small runs apart."""

from tuner.rules.units import gb


def test_small_figures_keep_three_significant_digits_large_ones_two_decimals():
    assert [gb(0.0341), gb(0.0365), gb(0.5), gb(0.999)] == ["0.0341", "0.0365", "0.500", "0.999"]
    assert [gb(1.0), gb(12.345), gb(80)] == ["1.00", "12.35", "80.00"]  # two decimals as before
    assert gb(None) == "-" and gb(0.0341, 7) == " 0.0341"
