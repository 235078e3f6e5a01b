"""Pictures and the offline HTML explainer: written, not blank, and (in Chromium) readable."""

import os
import subprocess
import tempfile

import matplotlib.image
import pytest
import torch

from attnlab import viz
from attnlab.cli import main
from attnlab.example import ExampleConfig, run_example
from attnlab.viz.explain import explain_html

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def assert_not_blank(png_path, min_bytes=10_000):
    assert os.path.getsize(png_path) > min_bytes
    pixels = torch.tensor(matplotlib.image.imread(str(png_path)))
    assert pixels.std() > 0.05, "the picture is (nearly) one colour"


def test_steps_heatmap_and_compare(tmp_path):
    trace = run_example(ExampleConfig(causal=True)).trace
    assert_not_blank(viz.save(viz.steps(trace), str(tmp_path / "steps.png")))
    ax = viz.heatmap(trace["weights"], kind="weights", tokens=["a", "b", "c", "d"])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c", "d"]
    assert any("Σ=1.00" in t.get_text() for t in ax.texts)  # row sums in the margin
    masked = viz.heatmap(trace["masked_scores"], kind="scores")
    (hatched,) = [c for c in masked.collections if c.get_label() == "masked"]
    assert len(hatched.get_paths()) == 6 and hatched.get_hatch() == "///"  # the 6 masked cells of a 4x4 causal mask
    viz.save(ax.figure, str(tmp_path / "w.svg"))
    assert (tmp_path / "w.svg").read_text().lstrip().startswith("<?xml")
    assert_not_blank(viz.save(viz.compare(trace["output"] * 1.1, trace["output"]), str(tmp_path / "c.png")))
    with pytest.raises(ValueError, match="kind must be"):
        viz.heatmap(trace["weights"], kind="nope")


def test_a_long_sequence_gets_a_few_ticks_not_one_per_position(tmp_path):
    # a tick per position of lab 04's 4096-long output took matplotlib ~20 s per picture
    ax = viz.heatmap(torch.randn(4096, 16), kind="values")
    assert len(ax.get_yticks()) <= 12 and [t.get_text() for t in ax.get_xticklabels()] == [str(i) for i in range(16)]
    assert_not_blank(viz.save(viz.compare(torch.randn(1, 4096, 16), torch.randn(1, 4096, 16)), str(tmp_path / "l.png")))


def test_cli_plot_example(tmp_path, capsys):
    assert main(["plot", "example", "--out", str(tmp_path / "s.png"), "--seq-len", "5"]) == 0
    assert_not_blank(tmp_path / "s.png")
    assert main(["plot", "example", "--out", str(tmp_path / "s.svg")]) == 0
    assert "<svg" in (tmp_path / "s.svg").read_text()
    assert main(["plot", "example", "--out", str(tmp_path / "s.jpg")]) == 2


@pytest.mark.slow
def test_explain_html_is_self_contained_and_complete(tmp_path):
    page = explain_html()
    for needle in ["Step 1: X", "Step 2: Q", "Step 5: scores", "Step 7: weights", "Step 8: output",
                   "-10.7618", "-4.4217", "id=\"causal\"", "<svg", "aria-label"]:
        assert needle in page, needle
    for fetch in ['src="http', "src='http", 'href="http', "url(http", "@import", 'src="//', "<link"]:
        assert fetch not in page, f"the page would fetch something: {fetch}"
    assert main(["explain", "--out", str(tmp_path / "e.html"), "--seq-len", "3"]) == 0
    assert "Step 1: X" in (tmp_path / "e.html").read_text()


def test_explain_warns_above_64_positions(capsys):
    explain_html(ExampleConfig(seq_len=65, d_model=4, d_k=2, d_v=2))
    assert "warning: 65 positions" in capsys.readouterr().err


@pytest.mark.browser
@pytest.mark.subprocess
def test_explain_page_in_headless_chromium(tmp_path):
    from helpers.ci import chromium

    browser = chromium()
    page = tmp_path / "explain.html"
    page.write_text(explain_html())
    profile = tempfile.mkdtemp()
    shot = tmp_path / "shot.png"
    run = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr",
                          "--v=0", f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert shot.exists(), run.stderr[-2000:]
    assert_not_blank(shot)
    console = [line for line in run.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    dom = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert 'data-ready="yes"' in dom  # the script ran to its end
    assert "Step 7: weights" in dom and "-10.7618" in dom
