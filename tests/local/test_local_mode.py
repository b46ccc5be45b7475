"""`pdcluster up` end to end: real processes, the official openai client, clean stop."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.local.cluster import local_cluster, pid_alive, ps_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_colocated_cluster_serves_openai_and_stops_cleanly(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    with local_cluster(ROOT / "examples" / "colocated.yaml", state_dir) as cluster:
        client = openai.OpenAI(base_url=cluster.endpoint + "/v1", api_key="unused")
        a = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
        b = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
        assert a.choices[0].text == b.choices[0].text
        assert a.usage is not None and a.usage.completion_tokens <= 8
        chunks = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
        )
        assert streamed == whole.choices[0].message.content
        ps = ps_text(state_dir)
        assert "colocated-0" in ps and "router" in ps and cluster.endpoint in ps
        pids = cluster.pids()
        assert all(pid_alive(p) for p in pids)
    assert not any(pid_alive(p) for p in pids), "processes left behind after Ctrl-C"
    assert not (state_dir / "colocated" / "state.json").exists()
