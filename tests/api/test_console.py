"""The web console (/console) in a real browser: headless Chromium driven by Selenium (the system's
/usr/bin/chromium and /usr/bin/chromedriver: .ci/run installs Debian's `chromium` and `chromium-driver`; nothing
is downloaded at run time). A real server; tenant ALICE trains a few steps, saves checkpoints and samples, tenant
BOB trains his own run, both through the official `tinker` SDK; then the browser signs in with each key and with
the admin key and checks what each sees: its sessions and runs only (an admin: everyone's), the loss curve (one
SVG point per step, the SDK's losses), checkpoint publish / unpublish / delete, the session's time-series panels,
the trace download (Chrome JSON trace with a span per request sent), and the admin view's counters. A screenshot
of each view is saved under the test's tmp dir."""

from __future__ import annotations

import collections
import itertools
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types as T

from tests.api import sdk_flows
from tests.api.server_proc import ADMIN_KEY, API_KEY, CLIENTS, Server
from tests.require import require_module, skip_or_fail

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
BOB = "tml-console-bob-key"
STEPS, BOB_STEPS = 3, 2

webdriver = require_module("selenium.webdriver")
from selenium.common.exceptions import (  # (after the check that selenium is there)
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait


def client(url: str, key: str) -> tinker.ServiceClient:
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    CLIENTS.setdefault(url, []).append(sc)
    return sc


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The server after ALICE's and BOB's SDK work; what each sent, for the checks."""
    tmp = tmp_path_factory.mktemp("console")
    srv = Server(tmp / "server", "--api-key", BOB)
    try:
        alice = client(srv.url, API_KEY)
        tc = alice.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
        losses = sdk_flows.train_steps(tc, sdk_flows.datums(0), STEPS)
        sampler_path = tc.save_weights_for_sampler("s1").result().path
        state_path = tc.save_state("w1").result().path
        out = alice.create_sampling_client(model_path=sampler_path).result().sample(
            T.ModelInput.from_ints([1, 2, 3]), 1, T.SamplingParams(max_tokens=2)).result()
        assert len(out.sequences[0].tokens) == 2
        bob = client(srv.url, BOB).create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
        sdk_flows.train_steps(bob, sdk_flows.datums(1), BOB_STEPS)
        runs = {key: srv.get(f"/api/v1/training_runs/{run}", key).json()
                for key, run in ((API_KEY, tc.model_id), (BOB, bob.model_id))}
        yield {"server": srv, "tmp": tmp, "run": tc.model_id, "bob_run": bob.model_id, "losses": losses,
               "session": runs[API_KEY]["model_owner"], "bob_session": runs[BOB]["model_owner"],
               "sampler_path": sampler_path, "state_path": state_path}
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser(work):
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            skip_or_fail(f"no {path}: install Debian's chromium and chromium-driver (apt-get install -y chromium "
                         "chromium-driver), as .ci/run does")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,2000"):
        options.add_argument(arg)
    downloads = work["tmp"] / "downloads"
    downloads.mkdir()
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER)))
    driver.downloads = downloads
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver, condition, timeout: float = 30):
    """`condition`'s first truthy value; elements the page re-renders meanwhile (stale) or has not drawn yet are
    looked for again."""
    ignored = (StaleElementReferenceException, NoSuchElementException)
    return WebDriverWait(driver, timeout, ignored_exceptions=ignored).until(condition)


def sign_in(driver, url: str, key: str, admin: bool = False) -> None:
    driver.get(f"{url}/console")
    driver.execute_script("sessionStorage.clear()")
    driver.get(f"{url}/console")
    wait(driver, EC.visibility_of_element_located((By.ID, "api-key"))).send_keys(key)
    driver.find_element(By.ID, "signin-button").click()
    wait(driver, lambda d: d.find_element(By.ID, "whoami").text.startswith("admin" if admin else "tenant"))
    wait(driver, EC.visibility_of_element_located((By.ID, "work-view")))
    assert driver.execute_script("return sessionStorage.getItem('tx-console-api-key')") == key


def rows(driver, table: str, attr: str) -> set[str]:
    """The ids in a table's rows once it has loaded (at least one row)."""
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr"))
    return {tr.get_attribute(attr) for tr in driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")}


def screenshot(driver, work, name: str) -> Path:
    path = work["tmp"] / f"console-{name}.png"
    assert driver.save_screenshot(str(path))
    assert path.is_file() and path.stat().st_size > 1000, path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return path


def open_run(driver, run: str) -> None:
    driver.find_element(By.CSS_SELECTOR, f'#runs-table tr[data-run-id="{run}"]').click()
    wait(driver, lambda d: d.find_element(By.ID, "run-title").text == run)


def checkpoint_row(driver, checkpoint_id: str):
    return driver.find_element(By.CSS_SELECTOR, f'#checkpoints-table tr[data-checkpoint-id="{checkpoint_id}"]')


def test_console_page_needs_no_key_and_loads_nothing_from_elsewhere(work):
    srv = work["server"]
    for path in ("/console", "/console/console.js", "/console/console.css"):
        r = httpx.get(srv.url + path, timeout=30)
        assert r.status_code == 200, path
        assert "default-src 'none'" in r.headers["content-security-policy"]
    assert httpx.get(srv.url + "/console/../api/v1/sessions", timeout=30).status_code in (401, 404)
    assert httpx.get(srv.url + "/console/secrets.txt", timeout=30).status_code == 404
    assert httpx.get(srv.url + "/api/v1/console/sessions", timeout=30).status_code == 401  # the data needs a key


def test_loss_history_route_is_the_owners(work):
    srv = work["server"]
    history = srv.get(f"/api/v1/training_runs/{work['run']}/loss_history").json()
    assert [s["step"] for s in history["steps"]] == list(range(1, STEPS + 1))
    assert [s["loss_sum"] for s in history["steps"]] == pytest.approx(work["losses"])
    assert all(s["tokens"] == 4 * sdk_flows.SEQ_LEN and s["passes"] == 1 for s in history["steps"])
    assert history["pending"] is None
    stranger = srv.get(f"/api/v1/training_runs/{work['run']}/loss_history", BOB)
    unknown = srv.get("/api/v1/training_runs/no-such-run/loss_history", BOB)
    assert stranger.status_code == unknown.status_code == 404
    assert srv.get(f"/api/v1/training_runs/{work['run']}/loss_history", ADMIN_KEY).status_code == 200
    mine = {s["session_id"] for s in srv.get("/api/v1/console/sessions").json()["sessions"]}
    assert mine == {work["session"]}
    everyone = {s["session_id"] for s in srv.get("/api/v1/console/sessions", ADMIN_KEY).json()["sessions"]}
    assert {work["session"], work["bob_session"]} <= everyone


def test_bad_key_is_refused(work, browser):
    browser.get(f"{work['server'].url}/console")
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{work['server'].url}/console")
    wait(browser, EC.visibility_of_element_located((By.ID, "api-key"))).send_keys("tml-not-a-key")
    browser.find_element(By.ID, "signin-button").click()
    wait(browser, lambda d: d.find_element(By.ID, "signin-error").text == "unknown API key")
    assert browser.execute_script("return sessionStorage.getItem('tx-console-api-key')") is None
    screenshot(browser, work, "signin")


def test_tenant_sees_its_session_run_and_loss_curve(work, browser):
    sign_in(browser, work["server"].url, API_KEY)
    assert rows(browser, "sessions-table", "data-session-id") == {work["session"]}
    assert rows(browser, "runs-table", "data-run-id") == {work["run"]}
    open_run(browser, work["run"])
    path = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#loss-svg path.series"))
    assert path.get_attribute("data-points") == str(STEPS)
    d = path.get_attribute("d")
    assert d.count("M") + d.count("L") == STEPS, d
    assert len(browser.find_elements(By.CSS_SELECTOR, "#loss-svg circle.point")) == STEPS
    # the curve is the SDK's losses: higher loss, lower on screen (larger y)
    ys = [float(p.split(",")[1]) for p in d.replace("M", " ").replace("L", " ").split()]
    losses = work["losses"]
    assert [a < b for a, b in itertools.pairwise(ys)] == [a > b for a, b in itertools.pairwise(losses)]
    assert browser.find_element(By.ID, "run-summary").text.startswith(f"{STEPS} steps")
    assert rows(browser, "checkpoints-table", "data-checkpoint-id") == {"sampler_weights/s1", "weights/w1"}
    screenshot(browser, work, "run")

    # the session's panels: requests, training utilization, tokens/s; latency per kind
    browser.find_element(By.CSS_SELECTOR, f'#sessions-table tr[data-session-id="{work["session"]}"]').click()
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#session-charts svg")) == 3)
    titles = [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#session-charts .chart-title")]
    assert titles == ["requests", "training utilization", "tokens / s"]
    assert browser.find_elements(By.CSS_SELECTOR, '#session-charts path.series[data-series="training"]')
    fb = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, '#latency-table tr[data-kind="forward_backward"]'))
    assert [td.text for td in fb.find_elements(By.TAG_NAME, "td")][:4] == ["forward_backward", str(STEPS), "0", "0"]
    screenshot(browser, work, "session")


def expected_requests(steps: int) -> collections.Counter:
    return collections.Counter({"create_model": 1, "forward_backward": steps, "optim_step": steps,
                                "save_weights_for_sampler": 1, "save_weights": 1, "sample": 1})


def test_trace_download(work, browser):
    sign_in(browser, work["server"].url, API_KEY)
    rows(browser, "sessions-table", "data-session-id")
    browser.find_element(By.CSS_SELECTOR, f'#sessions-table tr[data-session-id="{work["session"]}"]').click()
    button = browser.find_element(By.ID, "trace-download")
    wait(browser, lambda d: button.get_attribute("data-url"))
    url = button.get_attribute("data-url")
    assert url == f"/api/v1/sessions/{work['session']}/trace"
    # the URL the button fetches, with the key (without one: 401)
    assert httpx.get(work["server"].url + url, timeout=30).status_code == 401
    fetched = work["server"].get(url).json()
    # and the file the button's click saves
    button.click()
    target = browser.downloads / f"tx-{work['session']}.trace.json"
    wait(browser, lambda _: target.is_file() and target.stat().st_size > 0, timeout=30)
    time.sleep(0.5)  # (Chrome renames the .crdownload file once complete)
    downloaded = json.loads(target.read_text())
    for trace in (fetched, downloaded):
        assert isinstance(trace["traceEvents"], list)
        spans = [e for e in trace["traceEvents"] if e.get("cat") == "request"]
        assert all(e["ph"] == "X" and e["dur"] >= 0 for e in spans)
        assert collections.Counter(e["name"] for e in spans) == expected_requests(STEPS)
        assert {e["args"]["session_id"] for e in spans} == {work["session"]}
        assert {e["args"]["status"] for e in spans} == {"done"}


def test_checkpoint_publish_unpublish_delete(work, browser):
    srv = work["server"]
    sign_in(browser, srv.url, API_KEY)
    rows(browser, "runs-table", "data-run-id")
    open_run(browser, work["run"])
    wait(browser, lambda d: checkpoint_row(d, "sampler_weights/s1"))

    def public() -> bool:
        (c,) = [c for c in srv.get(f"/api/v1/training_runs/{work['run']}/checkpoints").json()["checkpoints"]
                if c["checkpoint_id"] == "sampler_weights/s1"]
        return c["public"]

    checkpoint_row(browser, "sampler_weights/s1").find_element(By.CSS_SELECTOR, "button.ckpt-publish").click()
    wait(browser, lambda d: checkpoint_row(d, "sampler_weights/s1").get_attribute("data-public") == "true")
    assert public()
    checkpoint_row(browser, "sampler_weights/s1").find_element(By.CSS_SELECTOR, "button.ckpt-unpublish").click()
    wait(browser, lambda d: checkpoint_row(d, "sampler_weights/s1").get_attribute("data-public") == "false")
    assert not public()
    checkpoint_row(browser, "weights/w1").find_element(By.CSS_SELECTOR, "button.ckpt-delete").click()
    wait(browser, EC.alert_is_present()).accept()
    wait(browser, lambda d: rows(d, "checkpoints-table", "data-checkpoint-id") == {"sampler_weights/s1"})
    listed = srv.get(f"/api/v1/training_runs/{work['run']}/checkpoints").json()["checkpoints"]
    assert [c["checkpoint_id"] for c in listed] == ["sampler_weights/s1"]


def test_another_tenant_sees_only_its_own_run(work, browser):
    sign_in(browser, work["server"].url, BOB)
    assert rows(browser, "runs-table", "data-run-id") == {work["bob_run"]}
    assert rows(browser, "sessions-table", "data-session-id") == {work["bob_session"]}
    assert work["run"] not in browser.find_element(By.ID, "work-view").text
    assert not browser.find_element(By.ID, "nav-admin").is_displayed()
    open_run(browser, work["bob_run"])
    path = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#loss-svg path.series"))
    assert path.get_attribute("data-points") == str(BOB_STEPS)
    screenshot(browser, work, "other-tenant")


def test_admin_sees_every_tenant_and_the_server(work, browser):
    sign_in(browser, work["server"].url, ADMIN_KEY, admin=True)
    wait(browser, lambda d: {work["run"], work["bob_run"]} <= rows(d, "runs-table", "data-run-id"))
    assert {work["session"], work["bob_session"]} <= rows(browser, "sessions-table", "data-session-id")
    open_run(browser, work["run"])  # an admin reads any run's loss curve
    path = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#loss-svg path.series"))
    assert path.get_attribute("data-points") == str(STEPS)
    screenshot(browser, work, "admin-runs")

    browser.find_element(By.ID, "nav-admin").click()
    wait(browser, EC.visibility_of_element_located((By.ID, "admin-view")))
    try:
        cards = wait(browser, lambda d: {c.get_attribute("data-card"): c.find_element(By.CLASS_NAME, "card-value").text
                                          for c in d.find_elements(By.CSS_SELECTOR, "#admin-cards .card")} or None)
    except TimeoutException:
        pytest.fail(f"no admin cards: {browser.find_element(By.ID, 'admin-error').text}")
    assert int(cards["rounds"]) > 0 and int(cards["compiles"]) > 0 and int(cards["backend calls"]) > 0
    assert cards.keys() >= {"KV pages in use", "prefix-cache hit rate"}
    calls = browser.find_element(By.ID, "admin-calls").text
    assert "forward_backward" in calls and "optim_step" in calls
    assert "tiny" in browser.find_element(By.ID, "admin-calls-by-base").text
    assert browser.find_elements(By.CSS_SELECTOR, "#admin-memory tbody tr")  # one row per device
    assert len(browser.find_elements(By.CSS_SELECTOR, "#admin-charts svg")) == 3
    screenshot(browser, work, "admin")
