"""schemathesis against the registry's OpenAPI document, on a real uvicorn server: no 5xx,
documented status codes and response schemas, and the admin token enforced (ignored_auth)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from registry.app import create_app
from registry.openapi import openapi_document
from registry.settings import RegistrySettings
from tests.registry.helpers import AUTH, live_server

MAX_EXAMPLES = 12

schema = schemathesis.openapi.from_dict(openapi_document(create_app(RegistrySettings(admin_token="schema-only"))))


@pytest.fixture(scope="module")
def live_url(make_settings):
    with live_server(make_settings()) as url:
        yield url


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_openapi_conformance(case, live_url):
    # Every built-in check (not_a_server_error, status_code/content_type/response_schema/headers
    # conformance, negative_data_rejection, ignored_auth, ...) except positive_data_acceptance: a
    # schema-valid body can still be refused with a documented 422 (unknown base, rank limit, ...).
    response = case.call(base_url=live_url, headers=dict(AUTH))
    if response.status_code == 400 and response.text.startswith("Invalid HTTP request"):
        return  # uvicorn refused malformed HTTP (fuzzed headers) before the app saw it
    case.validate_response(response, headers=dict(AUTH), excluded_checks=[positive_data_acceptance],
                           transport_kwargs={"base_url": live_url, "headers": dict(AUTH)})
