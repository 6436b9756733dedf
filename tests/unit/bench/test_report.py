"""`warmpath bench`'s PNG: drawn from a result document, with or without oracle bounds."""

from __future__ import annotations

import struct

import pytest

from bench.report import plot_live


def _result(with_oracle: bool) -> dict:
    def run(ttfts, hit_rate):
        records = [{"ttft_s": t, "error": None} for t in ttfts] + [{"ttft_s": None, "error": "HTTP 503"}]
        return {"records": records, "summary": {"hit_rate": hit_rate}}

    result = {
        "workload": "shared-tools", "num_replicas": 2,
        "policies": {"pow2": run([0.4, 0.5, 1.2], 0.84), "warmpath": run([0.2, 0.3, 0.9], 0.91),
                     "round-robin": run([], None)},
    }
    if with_oracle:
        result["oracle"] = {"warmpath": {"infinite_hit_rate": 0.93, "placed_hit_rate": 0.92}}
    return result


@pytest.mark.parametrize("with_oracle", [True, False])
def test_plot_is_a_png_of_the_figures_size(tmp_path, with_oracle):
    path = tmp_path / "plots" / "bench-shared-tools.png"
    plot_live(_result(with_oracle), path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (12 * 110, int(4.5 * 110))
