"""JSON logs, request ids and the /dashboard status page on a real gateway with two CPU workers.

Runs in the pytest process against one module-scoped gateway started with LOG_FORMAT=json and
API keys (so the page's admin-key box is exercised too). The page is driven in headless Chromium
through selenium; that test skips, saying why, where Chromium cannot start (.ci/run installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry

USER_KEY = "user-0123456789abcdefgh"
ADMIN_KEY = "admin-0123456789abcdefg"
MODELS = ("demo-a", "demo-b")
FAULTY = "test:tests.fault_engines.FaultyEngine"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROME_ARGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("logs") / "models.yaml",
        # demo-b runs the fault engine, which makes libraries warn on cue (<<warn>>).
        [demo_entry("demo-a", demo_model_dir), demo_entry("demo-b", demo_model_dir, engine=FAULTY)],
    )
    env = {
        "LOG_FORMAT": "json",
        "LOG_LEVEL": "INFO",
        "GATEWAY_API_KEYS": USER_KEY,
        "GATEWAY_ADMIN_KEYS": ADMIN_KEY,
        "GATEWAY_ALLOW_TEST_ENGINES": "1",
    }
    with GatewayProcess(config, env=env, wait_ready=False) as gw:

        def ready() -> bool:  # the harness's own wait sends no key; this one does
            assert gw.process is not None and gw.process.poll() is None, gw.log()  # died: fail now
            return (
                httpx.get(gw.url + "/health/ready", headers=bearer(ADMIN_KEY), timeout=2).status_code == 200
            )

        wait_until(ready, "the gateway to be ready", context=gw.log, retry_on=(httpx.HTTPError,))
        yield gw


def log_entries(gw: GatewayProcess) -> list[dict[str, Any]]:
    """Every line of the gateway's (and its workers') output, each of which must be JSON."""
    gw.log()  # flushes
    entries = []
    for line in gw.log_path.read_text(errors="replace").splitlines():
        if line.strip():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                pytest.fail(f"not a JSON log line: {line!r}")
    return entries


def wait_for_entry(gw: GatewayProcess, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    def last_match() -> dict[str, Any] | None:
        found = [entry for entry in log_entries(gw) if match(entry)]
        return found[-1] if found else None

    return wait_until(last_match, "such a log line", 30, context=gw.log)


def completion(gw: GatewayProcess, rid: str | None = None, **body: Any) -> httpx.Response:
    headers = bearer(USER_KEY) | ({"X-Request-ID": rid} if rid else {})
    payload = {"model": "demo-a", "prompt": "hello", "max_tokens": 8, **body}
    return httpx.post(gw.url + "/v1/completions", json=payload, headers=headers, timeout=60)


# ---- request ids --------------------------------------------------------------------------------


def test_request_id_is_echoed_or_generated(gateway: GatewayProcess) -> None:
    reply = completion(gateway, "given-id.1")
    assert reply.status_code == 200 and reply.headers["X-Request-ID"] == "given-id.1"
    generated = completion(gateway).headers["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    assert completion(gateway).headers["X-Request-ID"] != generated
    replaced = completion(gateway, "not allowed!").headers["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", replaced)
    unknown_model = completion(gateway, "missing-model-id", model="no-such-model")
    assert unknown_model.status_code == 404 and unknown_model.headers["X-Request-ID"] == "missing-model-id"
    no_route = httpx.get(gateway.url + "/no/such/route", headers=bearer(USER_KEY), timeout=10)
    assert no_route.status_code == 404 and re.fullmatch(r"[0-9a-f]{32}", no_route.headers["X-Request-ID"])
    refused = httpx.get(gateway.url + "/v1/models", headers={"X-Request-ID": "no-key"}, timeout=10)
    assert refused.status_code == 401 and refused.headers["X-Request-ID"] == "no-key"


def test_request_id_on_event_streams(gateway: GatewayProcess) -> None:
    headers = bearer(USER_KEY) | {"X-Request-ID": "sse-id-1"}
    payload = {"model": "demo-b", "prompt": "hi", "max_tokens": 8, "stream": True}
    with httpx.stream(
        "POST", gateway.url + "/v1/completions", json=payload, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["X-Request-ID"] == "sse-id-1"
        assert "data: [DONE]" in r.read().decode()
    line = wait_for_entry(
        gateway, lambda e: e["logger"] == "gateway.access" and e.get("request_id") == "sse-id-1"
    )
    assert line["status"] == 200 and line["model"] == "demo-b" and line["path"] == "/v1/completions"


# ---- the log ------------------------------------------------------------------------------------


def test_access_log_lines(gateway: GatewayProcess) -> None:
    assert completion(gateway, "access-1").status_code == 200
    line = wait_for_entry(
        gateway, lambda e: e["logger"] == "gateway.access" and e.get("request_id") == "access-1"
    )
    assert line["level"] == "INFO" and line["method"] == "POST" and line["path"] == "/v1/completions"
    assert line["status"] == 200 and line["model"] == "demo-a" and line["duration_ms"] >= 0
    assert line["key_name"] == "gateway_api_keys#1" and "key=gateway_api_keys#1" in line["message"]
    assert {"time", "level", "logger", "message"} <= line.keys()
    assert completion(gateway, "access-404", model="nope").status_code == 404
    missing = wait_for_entry(gateway, lambda e: e.get("request_id") == "access-404")
    assert missing["status"] == 404 and "model" not in missing
    text = gateway.log_path.read_text()
    assert USER_KEY not in text and ADMIN_KEY not in text  # names only, never the keys


def test_access_lines_carry_the_generation_and_the_real_outcome(gateway: GatewayProcess) -> None:
    assert completion(gateway, "gen-1", max_tokens=6, ignore_eos=True).status_code == 200
    line = wait_for_entry(
        gateway, lambda e: e["logger"] == "gateway.access" and e.get("request_id") == "gen-1"
    )
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] == 6 and line["finish_reason"] == "length"
    assert line["ttft_ms"] > 0 and line["worker"] == "demo-a#0" and line["client"] == "127.0.0.1"
    assert "tokens=" in line["message"] and "finish=length" in line["message"]

    # A stream that fails midway (its deadline passes after the first tokens): the line says 408, not
    # the 200 its headers carried. On the fault engine's slow cue (0.05 s a step), so that no machine
    # is fast enough to finish first.
    headers = bearer(USER_KEY) | {"X-Request-ID": "cut-1"}
    body = {
        "model": "demo-b",
        "prompt": "<<slow>> go",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
        "timeout": 1,
    }
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert "event: error" in text and "request_timeout" in text
    cut = wait_for_entry(
        gateway, lambda e: e["logger"] == "gateway.access" and e.get("request_id") == "cut-1"
    )
    assert cut["status"] == 408 and cut["completion_tokens"] > 0

    # A non-streaming request whose client gives up: its line is 499, not missing.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gateway.url + "/v1/completions",
            json={"model": "demo-b", "prompt": "<<slow>> go", "max_tokens": 1500, "ignore_eos": True},
            headers=bearer(USER_KEY) | {"X-Request-ID": "gone-1"},
            timeout=httpx.Timeout(60, read=0.5),
        )
    gone = wait_for_entry(
        gateway, lambda e: e["logger"] == "gateway.access" and e.get("request_id") == "gone-1"
    )
    assert gone["status"] == 499 and gone["model"] == "demo-b"


def test_supervisor_lines_name_worker_and_model(gateway: GatewayProcess) -> None:
    entries = [e for e in log_entries(gateway) if e["logger"].startswith("gateway.workers")]
    spawned = [e for e in entries if e["message"].startswith("spawned worker")]
    assert {e["model"] for e in spawned} == set(MODELS)
    assert all(e["worker"] == f"{e['model']}#0" for e in entries), entries


def test_state_change_lines_without_a_detail_end_at_the_state(gateway: GatewayProcess) -> None:
    """A change with no detail (to ready) ends with the new state: no stray space, which the text
    format showed as two spaces before the line's context."""
    changes = [e["message"] for e in log_entries(gateway) if e["logger"] == "gateway.link.handle"]
    for name in MODELS:
        assert any(re.fullmatch(rf"worker {name}#0: \w+ -> ready", m) for m in changes), changes
    assert all(m == m.strip() and "  " not in m for m in changes if " -> " in m), changes


def test_no_prompt_text_in_the_log(gateway: GatewayProcess) -> None:
    marker = f"zebra-{uuid.uuid4().hex}"
    assert completion(gateway, "prompt-1", prompt=f"say {marker}").status_code == 200
    chat = {"model": "demo-b", "messages": [{"role": "user", "content": marker}], "max_tokens": 4}
    reply = httpx.post(gateway.url + "/v1/chat/completions", json=chat, headers=bearer(USER_KEY), timeout=60)
    assert reply.status_code == 200
    too_long = completion(gateway, "prompt-2", prompt=f"{marker} " * 3000)  # an error path too
    assert too_long.status_code == 400
    wait_for_entry(gateway, lambda e: e.get("request_id") == "prompt-2" and e["logger"] == "gateway.access")
    assert marker not in gateway.log_path.read_text()


def test_workers_log_json_with_their_id(gateway: GatewayProcess) -> None:
    entries = log_entries(gateway)
    for name in MODELS:
        own = [e for e in entries if e["logger"].startswith("model_worker") and e.get("model") == name]
        assert own and all(e["worker"].startswith(f"{name}#") for e in own), name
        progress = [
            e
            for e in entries
            if e["logger"] == "gateway.observability.logging_setup" and e.get("worker", "").startswith(name)
        ]
        assert 1 <= len(progress) <= 11 and all(e["level"] == "INFO" for e in progress)


def test_library_warnings_in_a_worker_are_json_log_lines(gateway: GatewayProcess) -> None:
    reply = completion(gateway, model="demo-b", prompt="<<warn>> hello", max_tokens=2)
    assert reply.status_code == 200, reply.text
    # log_entries fails on any line that is not JSON, the warnings' source lines included.
    torch_warning = wait_for_entry(
        gateway, lambda e: e["logger"] == "py.warnings" and "set_default_tensor_type" in e["message"]
    )
    assert torch_warning["level"] == "WARNING" and torch_warning["worker"].startswith("demo-b#")
    injected = wait_for_entry(gateway, lambda e: "injected warning" in e["message"])
    assert "second line" in injected["message"] and injected["logger"] == "py.warnings"


# ---- the status page ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (test extra)")
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None or not Path(CHROMEDRIVER).exists():
        pytest.skip(
            f"headless Chromium unavailable (chromium binary: {chromium}, driver: {CHROMEDRIVER}); "
            ".ci/run installs both"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in CHROME_ARGS:
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    except WebDriverException as exc:
        pytest.skip(f"Chromium cannot start here: {exc.msg}")
    try:
        yield driver
    finally:
        driver.quit()


def cell_texts(driver: Any, selector: str) -> list[str]:
    """The shown text of every match, read in one script run: the page redraws its tables every
    second, so elements found first and read afterwards may be gone by then (stale)."""
    script = "return Array.from(document.querySelectorAll(arguments[0]), e => e.innerText.trim());"
    return list(driver.execute_script(script, selector))


def click(driver: Any, selector: str) -> None:
    """Click the element, finding it again if a redraw replaced it between finding and clicking."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def clicked(d: Any) -> bool:
        d.find_element(By.CSS_SELECTOR, selector).click()
        return True

    WebDriverWait(driver, 10, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException]).until(
        clicked
    )


def test_dashboard_shows_workers_and_throughput(gateway: GatewayProcess, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    page = httpx.get(gateway.url + "/dashboard", timeout=10)  # no key: the page holds no data
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)  # nothing loaded from elsewhere

    browser.get(gateway.url + "/dashboard")
    wait = WebDriverWait(browser, 30, poll_frequency=0.2)
    wait.until(lambda d: "admin key" in d.find_element(By.ID, "message").text)  # keys are configured
    browser.find_element(By.ID, "key").send_keys(ADMIN_KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()

    def rows_ready(driver: Any) -> bool:
        for name in MODELS:
            row = f'#workers tbody tr[data-model="{name}"]'
            if cell_texts(driver, f"{row} td.state .badge") != ["ready"]:
                return False
            if not all(pid.isdigit() for pid in cell_texts(driver, f"{row} td.pid") or ["-"]):
                return False
        return True

    wait.until(rows_ready)
    assert cell_texts(browser, '#models tbody tr[data-model="demo-a"] td.state')[0] == "ready"
    assert cell_texts(browser, "#overall") == ["ready"]
    assert "cpu" in cell_texts(browser, '#workers tbody tr[data-model="demo-a"] td.gpus')

    assert completion(gateway, "dash-1", max_tokens=64, ignore_eos=True).status_code == 200

    def rate(driver: Any) -> float:
        texts = cell_texts(driver, '#workers tbody tr[data-model="demo-a"] td.tps')
        return float(texts[0]) if texts and re.fullmatch(r"\d+\.\d", texts[0]) else 0.0

    WebDriverWait(browser, 20, poll_frequency=0.2).until(lambda d: rate(d) > 0)
    problems = [
        entry["message"]
        for entry in browser.get_log("browser")
        if "Content Security Policy" in entry["message"] or "Uncaught" in entry["message"]
    ]
    assert not problems, problems


def test_dashboard_acts_and_shows_error_rates(gateway: GatewayProcess, browser: Any) -> None:
    """With the admin key (typed in by the test above, kept in the tab), the page unloads, loads and
    reloads, and shows each model's error rate and latency over the last minutes."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(gateway.url + "/dashboard")
    wait = WebDriverWait(browser, 60, poll_frequency=0.2)
    row = '#models tbody tr[data-model="demo-b"]'

    def state(driver: Any) -> str:
        texts = cell_texts(driver, f"{row} td.state .badge")
        return texts[0] if texts else ""

    wait.until(lambda d: state(d) == "ready")
    click(browser, f"{row} button.unload")
    wait.until(lambda d: d.switch_to.alert).accept()  # "Unload demo-b? ..."
    wait.until(lambda d: state(d) == "unloaded")
    wait.until(lambda d: "unload demo-b: done (HTTP 200)" in cell_texts(d, "#action")[0])
    assert (
        httpx.get(gateway.url + "/health/ready/demo-b", headers=bearer(USER_KEY), timeout=5).status_code
        == 503
    )

    refused = completion(gateway, "dash-unloaded", model="demo-b")
    assert refused.status_code == 503  # a server-side failure: the error rate shows it
    wait.until(lambda d: cell_texts(d, f"{row} td.error-rate") not in ([], ["—"], ["0.0%"]))
    classes = browser.execute_script(
        "return document.querySelector(arguments[0]).className;", f"{row} td.error-rate"
    )
    assert "bad-rate" in classes
    latency = cell_texts(browser, '#models tbody tr[data-model="demo-a"] td.latency')[0]
    assert re.fullmatch(r"[\d.]+ m?s / [\d.]+ m?s", latency), latency

    click(browser, f"{row} button.load")
    wait.until(lambda d: state(d) == "ready")
    assert completion(gateway, "dash-back", model="demo-b").status_code == 200

    click(browser, "#reload")
    wait.until(lambda d: d.switch_to.alert).accept()
    wait.until(
        lambda d: re.search(
            r"reload \d+ applying: added 0, changed 0, retuned 0, removed 0", cell_texts(d, "#action")[0]
        )
    )
    problems = [e["message"] for e in browser.get_log("browser") if "Uncaught" in e["message"]]
    assert not problems, problems
