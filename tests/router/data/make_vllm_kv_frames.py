"""Write vllm_kv_frames.msgpack: KV-event messages exactly as vLLM's own
publisher sends them (`vllm.distributed.kv_events.ZmqEventPublisher`, 0.32),
read off its PUB socket and its replay socket.

Run with the interpreter that has vLLM (`.venv/bin/python -m e2e.vllmenv.build`
prints it), from the repository root:

    $VLLM_PYTHON tests/router/data/make_vllm_kv_frames.py tests/router/data/vllm_kv_frames.msgpack

The file is a msgpack map: "live" → the PUB messages ([topic, seq, payload]),
"replay" → the replay socket's answer to a request from batch 2, as a DEALER
receives it ([b"", topic, seq, payload], then the end marker).
"""

from __future__ import annotations

import sys
import time

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

TOPIC = "pdcluster.kv"


def batches() -> list[KVEventBatch]:
    # Blocks of 4 tokens. Int hashes are vLLM's default on the wire
    # (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); sha256 bytes when it is off.
    a, b = 0x1111_2222_3333_4444, 0xFFFF_0000_FFFF_0000
    c = bytes(range(32))
    return [
        KVEventBatch(
            ts=1.0,
            events=[
                BlockStored(
                    block_hashes=[a, b],
                    parent_block_hash=None,
                    token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                    block_size=4,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[None, None],
                    group_idx=0,
                    session_id="s-1",
                )
            ],
        ),
        KVEventBatch(
            ts=2.0,
            events=[
                BlockStored(
                    block_hashes=[c],
                    parent_block_hash=b,
                    token_ids=[9, 10, 11, 12],
                    block_size=4,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[("salt-1",)],
                ),
            ],
        ),
        KVEventBatch(ts=3.0, events=[BlockRemoved(block_hashes=[b], medium="GPU", group_idx=0)]),
        KVEventBatch(
            ts=4.0,
            events=[
                BlockStored(
                    block_hashes=[7],
                    parent_block_hash=None,
                    token_ids=[1, 2, 3, 4],
                    block_size=4,
                    lora_id=3,
                    medium="CPU",
                    lora_name="adapter",
                    extra_keys=[("adapter",)],
                ),
                AllBlocksCleared(),
            ],
        ),
    ]


def main(out: str) -> None:
    ctx = zmq.Context.instance()
    probe = ctx.socket(zmq.PUB)
    pub_port = probe.bind_to_random_port("tcp://127.0.0.1")
    replay_port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    publisher = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic=TOPIC,
    )
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    time.sleep(1.0)  # the subscription reaches the publisher
    sent = batches()
    for batch in sent:
        publisher.publish(batch)
    live = [sub.recv_multipart() for _ in sent]
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (2).to_bytes(8, "big")])
    replay = []
    while True:
        parts = dealer.recv_multipart()
        replay.append(parts)
        if parts[1] == b"":
            break
    publisher.shutdown()
    with open(out, "wb") as f:
        f.write(msgspec.msgpack.encode({"live": live, "replay": replay}))


if __name__ == "__main__":
    main(sys.argv[1])
