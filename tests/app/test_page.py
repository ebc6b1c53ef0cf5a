"""The web page, driven in headless Debian Chromium (Selenium, through the system chromedriver, so
nothing is downloaded) against live uvicorn servers over the real engine: ask (streamed), compare,
explain, documents, errors, the API key, phone width. Each view's screenshot goes to
$RAGBLEND_SCREENSHOTS (docs/screenshots when refreshing the committed ones), else a temp folder."""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from fastapi.testclient import TestClient

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,900"]
QUESTION = "Who built the lighthouse of Port Velmar?"
WAIT_S = 240  # a query on a loaded 2-core CPU can take a while


# ---- the page is served, without the key, and nothing else is opened by it ---------------------

def test_page_and_its_files_are_public_and_the_api_is_not(make_app, corpus):
    with TestClient(make_app(server={"api_key": "k-page"})) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for path, kind in [("/static/app.js", "javascript"), ("/static/style.css", "text/css"),
                           ("/favicon.ico", "image/svg+xml")]:
            response = client.get(path)
            assert response.status_code == 200 and kind in response.headers["content-type"], path
        assert client.get("/v1/documents").status_code == 401
        assert client.get("/static/../v1/documents").status_code in (401, 404)  # no way round the key
        missing = client.get("/static/nothing.js")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        assert "/" not in client.get("/openapi.json", headers={"Authorization": "Bearer k-page"}).json()["paths"]
    # Everything the page loads is its own: no CDN, no other origin.
    html = page.text + client.get("/static/app.js").text + client.get("/static/style.css").text
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text) and "@import" not in html
    assert not re.search(r"fetch\(\s*[\"'`]https?:", html)


# ---- the browser -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip(f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
                    "apt-get install -y chromium chromium-driver")
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="ragblend-chromium-")
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    # A Service with the driver's path: Selenium Manager (which could download one) never runs. It
    # starts chromedriver on a port found free, which another process may take first: then again.
    for attempt in range(3):
        try:
            driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
            break
        except WebDriverException:
            if attempt == 2:
                raise
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("RAGBLEND_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Page:
    """The page at `url` in `driver`, with the few moves the tests make."""

    def __init__(self, driver, url: str, shots: Path):
        self.driver, self.url, self.shots = driver, url, shots

    def open(self, view: str = "ask", width: int = 1280) -> Page:
        self.driver.set_window_size(width, 900)
        self.driver.get("about:blank")  # a fresh page, not a hash change on the last one
        self.driver.get(f"{self.url}/#{view}")
        self.wait(lambda d: d.execute_script("return document.readyState") == "complete")
        return self

    def find(self, css: str):
        from selenium.webdriver.common.by import By
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def find_all(self, css: str):
        from selenium.webdriver.common.by import By
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def text(self, css: str) -> str:
        """The element's text, found again where a re-render replaced it between the find and the read."""
        from selenium.common.exceptions import StaleElementReferenceException
        for _ in range(20):
            try:
                return self.find(css).text
            except StaleElementReferenceException:
                continue
        return self.find(css).text

    def wait(self, condition, timeout: float = WAIT_S):
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.support.ui import WebDriverWait
        return WebDriverWait(self.driver, timeout, poll_frequency=0.1,
                             ignored_exceptions=(StaleElementReferenceException,)).until(condition)

    def fill(self, css: str, value: str) -> None:
        field = self.find(css)
        field.clear()
        field.send_keys(value)

    def ask(self, question: str, submit_with_enter: bool = False, **controls: str) -> None:
        """Fill the shared query form and run the current view's action."""
        from selenium.webdriver.common.keys import Keys
        for name, value in controls.items():
            self.fill(f"#{name.replace('_', '-')}", str(value))
        self.fill("#question", question)
        if submit_with_enter:
            self.find("#question").send_keys(Keys.ENTER)
        else:
            self.find("#run").click()

    def wait_idle(self) -> None:
        """Until the run is over: the button is back and no spinner is left."""
        self.wait(lambda d: not d.find_element("id", "run").get_attribute("disabled")
                  and d.find_element("id", "busy").text == "")

    def error(self) -> str:
        box = self.find("#error")
        return box.text if box.is_displayed() else ""

    def screenshot(self, name: str) -> None:
        """The whole page, not just the viewport."""
        width = self.driver.execute_script("return window.innerWidth")
        height = self.driver.execute_script("return document.documentElement.scrollHeight")
        self.driver.set_window_size(self.driver.get_window_size()["width"], min(max(height + 120, 600), 4000))
        self.driver.save_screenshot(str(self.shots / f"{name}.png"))
        self.driver.set_window_size(self.driver.get_window_size()["width"], 900)
        assert width > 0


@pytest.fixture
def page(browser, live_server, shots) -> Page:
    return Page(browser, live_server.url, shots)


def query_api(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/query", json=body, timeout=WAIT_S)
    assert response.status_code == 200, response.text
    return response.json()


# ---- ask ---------------------------------------------------------------------------------------

def test_ask_streams_the_answer_then_shows_sources_and_stats(page):
    page.open("ask")
    # Record every state the answer passes through: streamed text grows in several steps.
    page.driver.execute_script("""
        window.answerStates = [];
        new MutationObserver(() => window.answerStates.push(document.getElementById('answer').textContent))
          .observe(document.getElementById('answer'), {childList: true, characterData: true, subtree: true});""")
    page.ask(QUESTION, submit_with_enter=True, max_tokens=24)  # the keyboard alone: type, Enter
    page.wait(lambda d: page.find_all("#stats [data-stat=ttft_ms]"))
    page.wait_idle()

    answer = page.text("#answer")
    assert "Quenby" in answer or "Ada" in answer, answer
    partial = [s for s in page.driver.execute_script("return window.answerStates") if s and s.strip() != answer]
    assert len(set(partial)) >= 2, f"the answer did not stream: {partial}"
    assert re.fullmatch(r"\d+ ms", page.text("#stats [data-stat=ttft_ms]"))
    recomputed = int(page.text("#stats [data-stat=recomputed_tokens]"))
    assert 0 < recomputed < int(page.text("#stats [data-stat=cached_tokens]"))
    assert re.search(r"(memory|disk|computed): \d", page.text("#stats [data-stat=store_hits]"))

    sources = page.find_all("#sources .source")
    assert len(sources) == 2 and "harbor" in sources[0].text and "Port Velmar lighthouse" in sources[0].text
    chunk = sources[0].find_element("css selector", ".chunk-text")
    assert not chunk.is_displayed()
    sources[0].find_element("css selector", "summary").click()  # expand the chunk text
    assert chunk.is_displayed() and "Ada Quenby" in chunk.text
    assert page.error() == ""
    page.screenshot("ask")


# ---- compare -----------------------------------------------------------------------------------

def test_compare_shows_both_answers_their_ttfts_and_the_speedup(page):
    page.open("compare")
    assert not page.find("#mode").is_displayed()  # compare always runs blend, then full
    page.ask("Who won the Halden Open in 2019?", max_tokens="24")
    page.wait(lambda d: page.text("#compare-verdict"))
    page.wait_idle()

    for column in ("#compare-blend", "#compare-full"):
        assert re.fullmatch(r"\d+ ms", page.text(f"{column} [data-field=ttft]")), column
        assert page.text(f"{column} [data-field=answer]"), column
    verdict = page.find("#compare-verdict")
    assert re.search(r"\d+\.\d\d× (faster|slower) than full prefill", verdict.text)
    same = page.text("#compare-blend [data-field=answer]") == page.text("#compare-full [data-field=answer]")
    assert ("Same answer" in verdict.text) == same
    assert len(page.find_all(".column.same" if same else ".column.differs")) == 2
    page.screenshot("compare")

    # Differing answers are marked word by word (drawn by the page's own code on a made-up pair).
    page.driver.execute_script("""
        const columns = {blend: document.getElementById('compare-blend'),
                         full: document.getElementById('compare-full')};
        markDifferences(columns, {blend: {answer: 'Mira Sokol won'}, full: {answer: 'Mira Brell won it'}}, false);""")
    assert [m.text for m in page.find_all("#compare-blend mark.diff")] == ["Sokol"]
    assert [m.text for m in page.find_all("#compare-full mark.diff")] == ["Brell", "it"]
    assert len(page.find_all(".column.differs")) == 2


# ---- explain -----------------------------------------------------------------------------------

def test_explain_highlights_exactly_the_recomputed_tokens(page, live_server):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    page.open("explain")
    page.ask(QUESTION, ratio="0.3", top_k="2")
    page.wait(lambda d: page.find_all("#explain-summary [data-stat=recomputed_tokens]"))
    page.wait_idle()

    highlighted = page.find_all("#prompt-map .tok.sel")
    shown = int(page.text("#explain-summary [data-stat=recomputed_tokens]"))
    api = query_api(live_server.url, question=QUESTION, recompute_ratio=0.3, top_k=2, max_tokens=1)["stats"]
    assert len(highlighted) == shown == api["recomputed_tokens"] > 0
    assert len(page.find_all("#prompt-map .tok")) == api["prompt_tokens"]
    assert len(page.find_all("#prompt-map .chunk")) == 4  # head, two passages, question
    assert page.find_all("#prompt-map .chunk.kind-passage .tok.exact")  # the first passage is an exact prefix
    question = page.find_all("#prompt-map .kind-question .tok")
    assert question and all("fresh" in t.get_attribute("class") for t in question)
    assert "Passage 1: harbor" in page.text("#prompt-map .kind-passage .chunk-title")
    heat = page.driver.execute_script("return arguments[0].map(t => Number(t.style.getPropertyValue('--heat')))",
                                      highlighted)
    assert max(heat) == pytest.approx(1.0, abs=1e-3)  # the top-scoring token is recomputed

    ActionChains(page.driver).move_to_element(highlighted[0]).perform()  # hover: its text and score
    info = page.text("#token-info")
    assert "recomputed" in info and re.search(r"score [\d.e+-]+", info)
    page.find("#prompt-map").send_keys(Keys.END)  # the keyboard: the last token is the question's
    assert "question, computed" in page.text("#token-info")
    page.find("#prompt-map").send_keys(Keys.HOME)
    assert "exact prefix" in page.text("#token-info")
    ActionChains(page.driver).move_to_element(highlighted[0]).perform()
    page.screenshot("explain")


# ---- documents ---------------------------------------------------------------------------------

def test_upload_a_document_then_ask_about_it_then_delete_it(page, live_server, tmp_path):
    doc = tmp_path / "ombra.md"
    doc.write_text("# The Ombra glacier\n\nThe Ombra glacier in the Tessel range was first crossed in 1931 by the "
                   "mountaineer Lina Varga, who carried a brass compass the whole way.\n")
    try:
        page.open("documents")
        page.wait(lambda d: page.find_all("#documents tr[data-doc=harbor]"))
        page.find("#upload-file").send_keys(str(doc))
        page.find("#upload-form button[type=submit]").click()
        page.wait(lambda d: "ombra: added" in page.text("#upload-result"))
        row = page.wait(lambda d: page.find_all("#documents tr[data-doc=ombra]"))[0]
        assert "The Ombra glacier" in row.text and page.error() == ""
        page.screenshot("documents")

        page.open("ask")
        page.ask("Who first crossed the Ombra glacier?", top_k="1", max_tokens="32")
        page.wait(lambda d: page.find_all("#stats [data-stat=ttft_ms]"))
        page.wait_idle()
        assert "ombra" in page.text("#sources .source") and re.search("Varga|Lina", page.text("#answer"))

        page.open("documents")
        page.wait(lambda d: page.find_all("#documents tr[data-doc=ombra]"))
        page.find("#documents tr[data-doc=ombra] button").click()
        page.driver.switch_to.alert.accept()
        page.wait(lambda d: "Deleted ombra" in page.text("#upload-result"))
        page.wait(lambda d: not page.find_all("#documents tr[data-doc=ombra]"))
    finally:  # the corpus is shared by the session: leave it as it was
        httpx.delete(f"{live_server.url}/v1/documents/{quote('ombra', safe='')}")


def settled_cache(url: str) -> dict:
    """GET /v1/cache once two reads half a second apart agree (the store's after-answer work has landed)."""
    last: dict = {}
    for _ in range(120):
        report = httpx.get(f"{url}/v1/cache").json()
        if report["tiers"] == last.get("tiers"):
            return report
        last = report
        time.sleep(0.5)
    return last


def test_the_documents_view_shows_the_cache_figures_and_a_lease_family(page, live_server):
    """A chat request with prompt_cache_retention 24h leases its prompt's KV: the documents view then shows each
    tier's entries, bytes and hit rate, the pinned bytes, and the family (by its hash), as GET /v1/cache says."""
    from store import family_id

    chat = httpx.post(f"{live_server.url}/v1/chat/completions", timeout=WAIT_S, json={
        "messages": [{"role": "user", "content": "Who won the Halden Open in 2019?"}], "max_tokens": 2, "top_k": 1,
        "prompt_cache_key": "page: figures", "prompt_cache_retention": "24h"})
    assert chat.status_code == 200 and chat.headers["x-ragblend-lease"] == "held", chat.text
    family = family_id("page: figures")
    try:
        page.open("documents")
        row = page.wait(lambda d: page.find_all(f"#cache-families tr[data-family='{family}']"))[0]
        cells = [td.text for td in row.find_elements("css selector", "td")]
        leased = chat.json()["lease"]["entries"]  # the head, the message and the passage, as the response said
        assert cells[0] == family[:12] and cells[1] == str(leased) and "memory" in cells[2] and "disk" in cells[2]
        report = settled_cache(live_server.url)  # the chat's after-answer storing done (it runs after the answer)
        page.find("#documents-refresh").click()
        page.wait(lambda d: page.find("#cache-tiers tr[data-tier=memory]").text.split()[:2] ==
                  ["memory", f"{report['tiers']['memory']['entries']:,}"])
        assert "%" in page.text("#cache-tiers tr[data-tier=disk]") and page.error() == ""
        assert re.match(r"Hit rate \d+\.\d %", page.text("#cache-summary"))
        assert f"holding {report['leased_entries']} entr" in page.text("#cache-summary")
        page.screenshot("documents-cache")

        httpx.delete(f"{live_server.url}/v1/cache", params={"prompt_cache_key": "page: figures"})
        page.find("#documents-refresh").click()  # the family is gone once the view is refreshed
        page.wait(lambda d: not page.find_all(f"#cache-families tr[data-family='{family}']"))
    finally:
        httpx.delete(f"{live_server.url}/v1/cache", params={"prompt_cache_key": "page: figures"})


def test_a_bad_upload_shows_the_servers_message(page, tmp_path):
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"id": "x", "text": "fine"}\nnot json\n')
    page.open("documents")
    page.find("#upload-file").send_keys(str(bad))
    page.find("#upload-form button[type=submit]").click()
    page.wait(lambda d: page.error())
    assert "Error 422" in page.error() and "broken.jsonl" in page.error()
    assert not page.find_all("#documents tr[data-doc=x]")


# ---- errors ------------------------------------------------------------------------------------

def test_a_bad_request_shows_the_servers_message(page):
    page.open("ask")
    page.ask(QUESTION, top_k="99")
    page.wait(lambda d: page.error())
    page.wait_idle()
    assert "Error 422: top_k: at most 16 (got 99)" in page.error()
    assert page.text("#answer") == ""


def test_busy_server_and_lost_connection_read_as_messages(browser, shots, stub_app, serve_live):
    app, engine = stub_app(step_s=0.3, server={"queue_size": 1})
    engine.gate.clear()  # every query waits: the queue fills
    with serve_live(app) as live, ThreadPoolExecutor(4) as pool:
        page = Page(browser, live.url, shots).open("ask")
        pending = []
        while not any(f.done() and f.result() == 429 for f in pending):  # fill the queue until it refuses
            assert len(pending) < 8, "the queue never filled"
            pending.append(pool.submit(lambda: httpx.post(f"{live.url}/v1/query", timeout=60,
                                                          json={"question": "q", "max_tokens": 1}).status_code))
            time.sleep(0.5)
        page.ask("anything?")
        page.wait(lambda d: page.error())
        page.wait_idle()
        assert "Error 429: too many requests waiting; retry later" in page.error() and "busy" in page.error()
        engine.gate.set()
        assert {f.result(30) for f in pending} <= {200, 429}

        page.ask("anything?", max_tokens="40")  # 40 deltas, 0.3 s apart: the server stops mid-answer
        page.wait(lambda d: page.text("#answer"))
    page.wait(lambda d: page.error(), timeout=60)
    page.wait_idle()
    assert "connection" in page.error().lower(), page.error()


# ---- the API key -------------------------------------------------------------------------------

def test_with_an_api_key_the_page_fails_cleanly_then_works_once_it_is_entered(browser, shots, make_app, corpus,
                                                                             serve_live):
    from selenium.webdriver.common.keys import Keys

    with serve_live(make_app(server={"api_key": "k-page"})) as live:
        page = Page(browser, live.url, shots).open("ask")
        page.wait(lambda d: "ready" in page.text("#health"))  # /health is public
        page.ask(QUESTION)
        page.wait(lambda d: page.error())
        page.wait_idle()
        assert "Error 401: missing or invalid API key" in page.error() and "enter the API key" in page.error()
        assert page.driver.switch_to.active_element.get_attribute("id") == "api-key"

        page.find("#api-key").send_keys("k-page", Keys.ENTER)
        page.find("#run").click()
        page.wait(lambda d: page.find_all("#stats [data-stat=ttft_ms]"))
        page.wait_idle()
        assert page.text("#answer") and page.error() == ""
        storage = page.driver.execute_script("return [sessionStorage.getItem('ragblend.apiKey'), localStorage.length]")
        assert storage == ["k-page", 0]  # kept for this tab only

        page.open("documents")
        page.wait(lambda d: page.find_all("#documents tr[data-doc=harbor]"))
        page.find("#key-forget").click()
        page.find("#documents-refresh").click()
        page.wait(lambda d: "Error 401" in page.error())


# ---- phone width -------------------------------------------------------------------------------

def test_phone_width_fits_without_sideways_scrolling(page):
    page.open("ask", width=390)
    page.ask(QUESTION, max_tokens="8")
    page.wait(lambda d: page.find_all("#stats [data-stat=ttft_ms]"))
    page.wait_idle()
    for view in ("ask", "compare", "explain", "documents"):
        page.driver.get(f"{page.url}/#{view}")
        overflow = page.driver.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 0, f"{view} is {overflow}px wider than the phone"
    page.driver.get(f"{page.url}/#ask")
    page.screenshot("phone")
