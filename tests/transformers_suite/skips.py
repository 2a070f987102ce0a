"""The one list of tests that do not run, each with its reason. Reviewed like code: every entry says why.

Keys are ``fnmatch`` patterns over ``"<variant>/<family>/<test name>"`` (variant: ``native`` or ``zoo``; test name
as pytest shows it, parameterized suffix included).
"""

SKIPS: dict[str, str] = {
    # A test that skips itself (no GPU, no flash-attention, "model is not composite", ...) is not listed;
    # RESULTS.md lists the tests whose outcome differs between native and zoo.
}


def reason_for(variant: str, family: str, name: str) -> str | None:
    from fnmatch import fnmatchcase

    key = f"{variant}/{family}/{name}"
    for pattern, reason in SKIPS.items():
        if fnmatchcase(key, pattern):
            return reason
    return None
