"""The vector-store routes on the real edge, a real nats-server and the real ingest service:
a tenant's collections and documents, and another tenant who can neither see, read, add to nor
delete them (answered exactly as for a collection that does not exist)."""

from __future__ import annotations

import anyio
import httpx
import pytest

from schemas import settings
from tests.stages.edge_harness import ACME_KEY, GLOBEX_KEY, keyring_for_tests, running_edge
from tools.stage import serve_stage

pytestmark = pytest.mark.anyio
TEXT = "# Ferry\nThe ferry to Skerry leaves at seven.\n\nIt returns at noon."


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_collections_and_files_per_tenant(tmp_path, bus_config, monkeypatch) -> None:
    monkeypatch.setenv(settings.RETRIEVAL_DB.name, str(tmp_path / "retrieval.duckdb"))
    keys = keyring_for_tests(tmp_path)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg, running_edge(bus_config, keys) as edge:
        ready = anyio.Event()
        tg.start_soon(
            lambda: serve_stage("ingest", config=bus_config, stop=stop, ready=ready, handle_signals=False)
        )  # fmt: skip
        with anyio.fail_after(60):
            await ready.wait()
        async with httpx.AsyncClient(base_url=edge.url, timeout=120) as http:
            acme, globex = auth(ACME_KEY), auth(GLOBEX_KEY)
            made = await http.post("/v1/vector_stores", json={"name": "island"}, headers=acme)
            assert made.status_code == 200 and made.json()["id"] == "island"
            assert made.json()["object"] == "vector_store"
            added = await http.post(
                "/v1/vector_stores/island/files", json={"text": TEXT, "source": "ferry.md"},
                headers=acme,
            )  # fmt: skip
            body = added.json()
            assert added.status_code == 200 and body["status"] == "completed", body
            assert body["num_chunks"] == 1 and body["source"] == "ferry.md"
            again = await http.post(
                "/v1/vector_stores/island/files", json={"text": TEXT}, headers=acme
            )
            assert again.json()["id"] == body["id"] and again.json()["already_present"] is True
            files = (await http.get("/v1/vector_stores/island/files", headers=acme)).json()
            assert [f["id"] for f in files["data"]] == [body["id"]]
            listed = (await http.get("/v1/vector_stores", headers=acme)).json()["data"]
            assert [(s["id"], s["file_counts"]["total"]) for s in listed] == [("island", 1)]

            # globex: nothing listed, and every route on acme's collection is a 404 as for none
            assert (await http.get("/v1/vector_stores", headers=globex)).json()["data"] == []
            missing = await http.get("/v1/vector_stores/nowhere", headers=globex)
            for call in (
                http.get("/v1/vector_stores/island", headers=globex),
                http.get("/v1/vector_stores/island/files", headers=globex),
                http.post("/v1/vector_stores/island/files", json={"text": "x"}, headers=globex),
                http.delete(f"/v1/vector_stores/island/files/{body['id']}", headers=globex),
                http.delete("/v1/vector_stores/island", headers=globex),
            ):
                r = await call
                assert r.status_code == 404, r.text
                assert r.json()["error"]["message"] == "no collection named 'island'"
            assert missing.json()["error"]["message"] == "no collection named 'nowhere'"
            assert (await http.get("/v1/vector_stores/island", headers=acme)).status_code == 200

            # errors name what is wrong; no key is a 401
            bad = await http.post("/v1/vector_stores", json={"name": "a b"}, headers=acme)
            assert bad.status_code == 400 and "collection name" in bad.json()["error"]["message"]
            assert (await http.get("/v1/vector_stores")).status_code == 401

            gone = await http.delete(f"/v1/vector_stores/island/files/{body['id']}", headers=acme)
            assert gone.json() == {"id": body["id"], "object": "vector_store.file.deleted", "deleted": True}  # fmt: skip
            deleted = await http.delete("/v1/vector_stores/island", headers=acme)
            assert deleted.json()["deleted"] is True
            assert (await http.get("/v1/vector_stores", headers=acme)).json()["data"] == []
        stop.set()
