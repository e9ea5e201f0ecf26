"""The README's Python examples run as written (in order, one namespace)."""
import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.skipif(not README.exists(), reason="README.md is not next to the tests (installed copy)")
def test_readme_examples_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write files
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    ns = {}
    for code in blocks:
        exec(compile(code, str(README), "exec"), ns)
    cache, sid = ns["cache"], ns["sid"]
    # the StreamingLLM example: 4 sinks + 1020 recent + the newest token
    kept = cache.kept_positions(sid)
    assert len(kept) == 1025
    np.testing.assert_array_equal(kept[:5], [0, 1, 2, 3, 3979])
    assert kept[-1] == 4999
    assert "blocks" in capsys.readouterr().out
    # the prefix-caching example: 62 blocks hit, the loaded copy equals the original
    pc, a, b, c = ns["pc"], ns["a"], ns["b"], ns["c"]
    assert pc.stats().prefix_hit_blocks == 62 and pc.sequence_ids() == [c]
    assert pc.seq_len(c) == 1000


@pytest.mark.skipif(not README.exists(), reason="README.md is not next to the tests (installed copy)")
def test_readme_serving_example_runs(capsys):
    """The continuous-batching example (the block tagged ``python serve``; needs the hf extra)."""
    pytest.importorskip("transformers")
    blocks = re.findall(r"```python serve\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1
    ns = {}
    exec(compile(blocks[0], str(README), "exec"), ns)
    batcher, rids, outputs = ns["batcher"], ns["rids"], ns["outputs"]
    assert sorted(outputs) == rids and [len(outputs[r]) for r in rids] == [16, 16, 16, 4]
    assert batcher.stats().prefix_hit_tokens == 32
    assert batcher.cache.num_free_blocks == batcher.cache.num_blocks
    assert batcher.stats().num_blocks == (8 << 20) // batcher.cache.bytes_per_block
    events = capsys.readouterr().out.splitlines()
    assert len(events) >= 4 and events[-1] == "32"
