"""Image decoders against files passed off as images (dataset rows, agents' requests to the endpoint).

Pillow opens some 40 formats unless told which; an EPS reaches Ghostscript where one is installed. The project opens
only the formats it lists (``hpc_rlhf.data.images.IMAGE_FORMATS``): an EPS labelled ``image/png`` is a ``DataError``
naming its row, or the endpoint's 400, and Pillow's Ghostscript call is never reached. A named pipe as an image path
is refused instead of blocking the loader. Each test fails fast, naming what got through.
"""

from __future__ import annotations

import base64
import os
import threading

import pytest
from PIL import EpsImagePlugin, Image

from hpc_rlhf.agents.openai_images import message_image_refs
from hpc_rlhf.agents.openai_requests import EndpointRequestError
from hpc_rlhf.data.images import ImageRef
from hpc_rlhf.data.sources import DataError

EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
       b"newpath 0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n")


@pytest.fixture
def ghostscript_calls(monkeypatch):
    """Pillow's call into Ghostscript, recorded instead of run."""
    calls = []

    def fake_ghostscript(*args, **kwargs):
        calls.append(args)
        raise OSError("Ghostscript reached (recorded by the test, not run)")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", fake_ghostscript)
    monkeypatch.setattr(EpsImagePlugin, "has_ghostscript", lambda: True)
    return calls


def test_the_probe_is_an_eps_that_pillow_would_hand_to_ghostscript(ghostscript_calls):
    import io

    with Image.open(io.BytesIO(EPS)) as image:  # no formats=: what the loaders did before
        assert image.format == "EPS"
        with pytest.raises(OSError, match="Ghostscript reached"):
            image.load()
    assert ghostscript_calls


def test_an_eps_in_a_dataset_row_is_a_data_error_and_never_reaches_ghostscript(ghostscript_calls, tmp_path):
    path = tmp_path / "cat.png"
    path.write_bytes(EPS)
    for ref in (ImageRef(str(path), None, "rows.jsonl", 3, "images"), ImageRef(None, EPS, "rows.jsonl", 4, "images")):
        with pytest.raises(DataError, match=r"rows\.jsonl.*unreadable"):
            ref.check()
        with pytest.raises(DataError, match=r"rows\.jsonl.*unreadable"):
            ref.load()
    assert not ghostscript_calls, f"an EPS reached Ghostscript: {ghostscript_calls}"


def test_an_eps_sent_to_the_endpoint_as_png_is_a_400(ghostscript_calls):
    url = "data:image/png;base64," + base64.b64encode(EPS).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "what is this?"}]}]
    with pytest.raises(EndpointRequestError, match=r"messages\[0\]\.content\[0\]"):
        message_image_refs(messages)
    assert not ghostscript_calls, f"an EPS reached Ghostscript: {ghostscript_calls}"


def test_a_named_pipe_as_an_image_path_is_refused_not_waited_on(tmp_path):
    pipe = tmp_path / "image.png"
    os.mkfifo(pipe)
    outcome: dict = {}

    def check() -> None:
        try:
            ImageRef(str(pipe), None, "rows.jsonl", 7, "images").check()
            outcome["result"] = "accepted"
        except DataError as err:
            outcome["result"] = str(err)

    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    thread.join(timeout=10)
    if thread.is_alive():  # free the blocked open so the thread ends
        with open(pipe, "wb"):
            pass
        pytest.fail("the loader blocked opening a named pipe given as an image path")
    assert "not a regular file" in outcome["result"] and "rows.jsonl" in outcome["result"], outcome
