"""Document names as a reader sees them: the NFC and NFD spellings of one file name are one document, and an id or
title with a bidirectional control (which makes it read otherwise than it is) is refused."""
from __future__ import annotations

import unicodedata

import pytest

from app.validation import valid_doc_id

pytestmark = pytest.mark.slow

NFC, NFD = "caf\u00e9 notes", unicodedata.normalize("NFD", "caf\u00e9 notes")


def test_nfc_and_nfd_file_names_are_one_document(client):
    text = "The Caf\u00e9 Orrin serves tea at noon."
    first = client.post("/v1/documents", files={"file": (f"{NFD}.txt", text.encode(), "text/plain")})
    assert first.status_code == 201, first.text
    assert first.json()["data"][0]["id"] == NFC
    again = client.post("/v1/documents", files={"file": (f"{NFC}.txt", text.encode(), "text/plain")})
    assert again.json()["data"][0]["status"] == "unchanged"
    assert [d["id"] for d in client.get("/v1/documents").json()["data"]].count(NFC) == 1
    assert client.get(f"/v1/documents/{NFD}").json()["id"] == NFC  # either spelling finds it
    assert client.delete(f"/v1/documents/{NFD}").status_code == 200
    assert client.get(f"/v1/documents/{NFC}").status_code == 404


@pytest.mark.parametrize("control", ["\u202e", "\u2066", "\u200f"])
def test_ids_and_titles_with_bidi_controls_are_refused(client, control):
    for param, body in (("id", {"id": f"invoice{control}fdp.exe", "text": "x y z"}),
                        ("title", {"id": "fine", "title": f"report{control}", "text": "x y z"})):
        response = client.post("/v1/documents", json=body)
        assert response.status_code == 422 and response.json()["error"]["param"] == param, response.text
    upload = client.post("/v1/documents", files={"file": (f"a{control}b.txt", b"x y z", "text/plain")})
    assert upload.status_code == 422, upload.text
    with pytest.raises(ValueError):
        valid_doc_id(f"a{control}b")
