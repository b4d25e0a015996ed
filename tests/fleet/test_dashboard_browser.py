"""The fleet dashboard in a real headless Chromium (Debian's package, driven by Playwright)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from django.contrib.auth.models import User

from catalog.models import RenderConfig, ServedModel
from fleet import reports
from fleet.models import BreakerState, EngineInstance, ManagedProcess
from fleet.services import api_key_create, instance_create
from serving.pipeline import metrics

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


@pytest.fixture
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium: `python3 -m toolchain ensure chromium` installs it (as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def sick_fleet(transactional_db: None, settings: Any) -> list[EngineInstance]:
    settings.REDIS_URL = ""  # the reports go to the database, as under `make run` without Redis
    model = ServedModel.objects.create(name="tiny", model_path="/m/tiny")
    RenderConfig.objects.create(name="default", health="healthy", sidecar_version="0.33.0")
    made = [instance_create(actor="test", name=f"union-{n}", url=f"http://127.0.0.1:82{n:02d}", served_model_id=model.id) for n in (1, 2, 3)]
    EngineInstance.objects.filter(id=made[0].id).update(health="healthy")
    EngineInstance.objects.filter(id=made[1].id).update(health="failing", last_probe_ok=False, last_probe_error="ConnectError: refused")
    BreakerState.for_instance(made[2].id).force_open(actor="test", seconds=60)
    # The launcher's view: union-1 came back after one crash; union-2's process is restarting.
    ManagedProcess.objects.create(name="engine-1", instance=made[0], restarts=1, last_exit_reason="killed by SIGKILL")
    ManagedProcess.objects.create(
        name="engine-2", instance=made[1], state=ManagedProcess.State.BACKOFF, restarts=2,
        last_exit_reason="engine core killed by SIGILL (then the process exited with code 0)",
    )
    User.objects.create_user("ops", password="ops-pass-1", is_staff=True)
    # Traffic as the request path records it: union-2 keeps failing, union-1 is fine.
    metrics.REGISTRY.clear()
    for k in range(20):
        metrics.record_request("union-1", 0.02 + k * 0.001, 0.005, ok=True)
        metrics.record_request("union-2", None, None, ok=k % 4 == 0)
    # Another coordinator replica served union-3 (before its breaker opened) and reported it.
    other = metrics.MetricsRegistry()
    for _ in range(5):
        other.record_request("union-3", 0.04, 0.006, ok=True)
    reports.report_write(host="coordinator-b", pid=4242, payload={
        "series": other.export(), "in_flight": {"union-3": 30},
        "route_decisions": [["tiny", "native", "stop_strings", 4], ["tiny", "refused", "api:messages", 1]]})
    # union-1's capability probe found it tokens-only behind a record that grants the native API.
    EngineInstance.objects.filter(id=made[0].id).update(cap_native_openai=True, capabilities={
        "version": "0.32.0", "token_in": True, "routes": {"generate": True, "native": ["chat"]},
        "tokenizer_loaded": False, "lora": {"enabled": False, "adapters": []}})
    return made


def test_it_shows_the_fleet_and_its_plots_in_chromium(sick_fleet: list[EngineInstance], live_server: Any, browser: Any) -> None:
    # Fixture order matters: Playwright's sync API runs an event loop in this thread, and Django
    # refuses ORM calls there, so the rows are written before the browser starts.
    page = browser.new_page(viewport={"width": 1400, "height": 700})
    try:
        page.goto(f"{live_server.url}/admin/login/?next=/admin/fleet/dashboard/")
        page.fill("#id_username", "ops")
        page.fill("#id_password", "ops-pass-1")
        page.click("input[type=submit]")
        page.wait_for_url("**/admin/fleet/dashboard/")
        rows = page.locator("tr.instance")
        assert rows.count() == 3
        for instance in sick_fleet:
            row = page.locator(f'tr[data-instance="{instance.name}"]')
            for field in ("role", "state", "health", "breaker", "in-flight", "restarts", "last-probe"):
                assert row.locator(f'[data-field="{field}"]').inner_text().strip(), (instance.name, field)
            for plot in ("ttft", "tpot", "rate", "errors"):
                svg = row.locator(f'[data-plot="{plot}"] svg.spark')
                assert svg.count() == 1 and svg.bounding_box()["width"] > 0, (instance.name, plot)
        sick = page.locator('tr[data-sick="true"]')
        assert sorted(sick.nth(i).get_attribute("data-instance") for i in range(sick.count())) == ["union-2", "union-3"]
        assert page.locator('tr[data-instance="union-2"] [data-field="health"]').inner_text().strip() == "failing"
        assert page.locator('tr[data-instance="union-3"] [data-field="breaker"]').inner_text().strip() == "open"
        process = page.locator('tr[data-instance="union-2"] [data-field="process"]').inner_text()
        assert process.startswith("restarting") and "engine core killed by SIGILL" in process
        assert page.locator('tr[data-instance="union-1"] [data-field="process"]').inner_text().startswith("running")
        assert page.locator('tr[data-instance="union-3"] [data-field="process"]').inner_text().strip() == "–"
        restarts = {i.name: page.locator(f'tr[data-instance="{i.name}"] [data-field="restarts"]').inner_text().strip() for i in sick_fleet}
        assert restarts == {"union-1": "1", "union-2": "2", "union-3": "–"}
        assert page.locator("#fleet thead th", has_text="restarts").count() == 1
        # The table fits the admin's layout at 1400 px: no wider than the header, no page scroll.
        header = page.locator("#header").bounding_box()
        table = page.locator("#fleet").bounding_box()
        assert table["x"] >= header["x"] and table["x"] + table["width"] <= header["x"] + header["width"], (table, header)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1400
        # The other replica's traffic is drawn here too: the plots are the whole fleet's.
        assert "added up over 2 coordinator processes" in page.locator("#content-main p.help").inner_text()
        union_3 = page.locator('tr[data-instance="union-3"]')
        assert union_3.locator('[data-plot="rate"] .num').inner_text().strip() == "5 in the last minute"
        assert union_3.locator('[data-field="in-flight"]').inner_text().strip() == "30"
        assert union_3.locator('[data-plot="ttft"] .num').inner_text().strip() == "40.0 ms"
        # What each engine serves, and why each model's requests went native (the other replica's counts).
        capabilities = page.locator('tr[data-instance="union-1"] [data-field="capabilities"]').inner_text()
        assert "no native: tokens-only (no tokenizer loaded)" in capabilities
        stop = page.locator('#native-reasons tr[data-model="tiny"][data-reason="stop_strings"]')
        assert stop.locator('[data-field="native"]').inner_text().strip() == "4"
        refused = page.locator('#native-reasons tr[data-model="tiny"][data-reason="api:messages"]')
        assert refused.locator('[data-field="refused"]').inner_text().strip() == "1"
        # Drawn lines, not empty boxes: union-1 has TTFT points, union-2 error points.
        assert page.locator('tr[data-instance="union-1"] [data-plot="ttft"] svg :is(polyline, circle)').count() >= 1
        assert page.locator('tr[data-instance="union-2"] [data-plot="errors"] svg :is(polyline, circle)').count() >= 1
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        # Narrower, the page still does not scroll sideways: the table's own box scrolls instead.
        for width in (1280, 1024):
            page.set_viewport_size({"width": width, "height": 700})
            assert page.evaluate("document.documentElement.scrollWidth") <= width, width
            wrap = page.locator("#fleet-wrap").bounding_box()
            assert wrap["x"] + wrap["width"] <= width, (width, wrap)
    finally:
        page.close()
        metrics.REGISTRY.clear()
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 1000


@pytest.fixture
def admin_key(sick_fleet: list[EngineInstance]) -> str:
    # Written before the browser starts (see the ORM note above). The dashboard needs staff only;
    # the engine changelist and its actions need the model's permissions.
    User.objects.filter(username="ops").update(is_superuser=True)
    return api_key_create(name="ops-key", scope="admin")[1]


def test_the_admin_reads_as_an_operator_reads_it_in_chromium(
    sick_fleet: list[EngineInstance], admin_key: str, live_server: Any, browser: Any,
) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 700})
    try:
        page.goto(f"{live_server.url}/admin/login/?next=/admin/")
        page.fill("#id_username", "ops")
        page.fill("#id_password", "ops-pass-1")
        page.click("input[type=submit]")
        page.wait_for_url("**/admin/")
        # Titled for the project, not "Django administration".
        assert page.title() == "Fleet, models and keys | motorsite admin"
        assert page.locator("#site-name").inner_text().strip() == "motorsite fleet administration"
        # An operator acts through the REST API, then in the admin, on the same engine.
        union_1 = sick_fleet[0]
        drained = page.request.post(
            f"{live_server.url}/api/instances/{union_1.id}/drain", headers={"Authorization": f"Bearer {admin_key}"}
        )
        assert drained.status == 200 and drained.json()["state"] == "draining"
        page.goto(f"{live_server.url}/admin/fleet/engineinstance/")
        row = page.locator("#result_list tbody tr", has_text="union-1")
        # "No drift" is a word, not Django's red cross; the breaker column is the state alone.
        assert row.locator("td.field-drift").inner_text().strip() == "none"
        assert row.locator("td.field-drift img").count() == 0
        assert row.locator("td.field-breaker_column").inner_text().strip() == "closed"
        open_row = page.locator("#result_list tbody tr", has_text="union-3")
        assert open_row.locator("td.field-breaker_column").inner_text().startswith("open until ")
        row.locator("input.action-select").check()
        page.select_option("select[name=action]", "undrain")
        page.click("button[name=index]")
        assert "Undrained 1 engine(s)" in page.locator("ul.messagelist").inner_text()
        page.goto(f"{live_server.url}/admin/fleet/engineinstance/{union_1.id}/history/")
        history = page.locator("#fleet-history tbody tr")
        assert history.count() == 2
        assert [history.nth(i).locator("td").nth(0).inner_text() for i in range(2)] == ["admin:ops", "api:ops-key"]
        assert "draining → active" in history.nth(0).inner_text() and "active → draining" in history.nth(1).inner_text()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "admin-history.png"), full_page=True)
    finally:
        page.close()
