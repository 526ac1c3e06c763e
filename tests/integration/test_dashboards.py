"""The shipped Grafana dashboard and Prometheus alerting rules match what a real gateway exports.

Runs in the pytest process: `promtool` (Debian's prometheus package, installed by .ci/run) checks and
unit-tests deploy/prometheus/alerts.yaml, and every metric the dashboard and the rules name is looked
up in the /metrics of a real gateway with two CPU workers after real requests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import REPO_ROOT, GatewayProcess

RULES = REPO_ROOT / "deploy" / "prometheus" / "alerts.yaml"
RULE_TESTS = REPO_ROOT / "deploy" / "prometheus" / "alerts.test.yaml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "llm-gateway.json"
METRIC_NAME = re.compile(r"\b((?:gateway|process)_[a-z0-9_]+)\b")
# Exported only where an engine reports GPU memory (a GPU worker): not by the CPU engine here.
GPU_ONLY = {"gateway_worker_gpu_memory_used_bytes"}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: .ci/run installs Debian's prometheus package")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def rule_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [var["query"] for var in dashboard["templating"]["list"] if var["type"] == "query"]
    return exprs


def test_alert_rules_are_valid_and_fire_as_their_tests_say() -> None:
    tool = promtool()
    checked = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [tool, "test", "rules", RULE_TESTS.name], capture_output=True, text=True, timeout=60, cwd=RULES.parent
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = {
        rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    }
    tested_alerts = {
        case["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"][0]["alert_rule_test"]
    }
    assert alerts == tested_alerts, "every alert has a promtool test case"


def test_dashboard_is_importable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_all_models_includes_requests_refused_before_a_model_was_known() -> None:
    """401s, 404s and the 429s of a key's rate limit or budget on a request that names no model
    are counted with model="" (label values stay the served names whatever clients send). "All"
    must match them too, or the per-key panel never shows a key hitting its limits there; a model
    without a worker (on demand, not loaded) is missing from the variable's list and must still
    count in "All"."""
    dashboard = json.loads(DASHBOARD.read_text())
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "model")
    assert variable["includeAll"] and re.fullmatch(variable.get("allValue") or "$^", ""), variable
    assert re.fullmatch(variable["allValue"], "demo-small")


def scraped_sample_names(gateway: GatewayProcess) -> set[str]:
    chat = {"model": "demo-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(gateway.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
    with httpx.stream(
        "POST",
        gateway.url + "/v1/completions",
        timeout=60,
        json={"model": "demo-medium", "prompt": "hi", "max_tokens": 4, "stream": True},
    ) as streamed:
        assert streamed.status_code == 200
        streamed.read()
    missing = httpx.post(gateway.url + "/v1/chat/completions", json={"model": "demo-small"}, timeout=60)
    assert missing.status_code == 400
    text = httpx.get(gateway.url + "/metrics", timeout=30).text
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_every_metric_the_dashboard_and_rules_name_is_exported(two_model_gateway: GatewayProcess) -> None:
    exported = scraped_sample_names(two_model_gateway)
    named = {
        name for expr in rule_expressions() + dashboard_expressions() for name in METRIC_NAME.findall(expr)
    }
    assert named, "the expressions name metrics"
    observability = REPO_ROOT / "gateway" / "observability"
    source = "".join((observability / name).read_text() for name in ("metrics.py", "worker_collector.py"))
    for name in sorted(named):
        if name in GPU_ONLY:
            assert f'"{name}"' in source, f"{name} is no longer defined in gateway/observability"
            continue
        assert name in exported, f"{name} is named by the dashboard or the rules but not exported"
