"""The one list of tests that do not run, each with its reason. Reviewed like code: every entry says why.

Keys are ``fnmatch`` patterns over ``"<variant>/<family>/<test name>"`` (variant: ``native`` or ``zoo``; test name
as pytest shows it, parameterized suffix included).
"""

SKIPS: dict[str, str] = {
    # -- the zoo has no such classes --------------------------------------------------------------------------------
    "zoo/*/test_sequence_classification_model*": "the zoo makes no sequence-classification head (Model and ForCausalLM only)",
    "zoo/*/test_token_classification_model": "the zoo makes no token-classification head (Model and ForCausalLM only)",
    "zoo/*/test_question_answering_model": "the zoo makes no question-answering head (Model and ForCausalLM only)",
}


def reason_for(variant: str, family: str, name: str) -> str | None:
    from fnmatch import fnmatchcase

    key = f"{variant}/{family}/{name}"
    for pattern, reason in SKIPS.items():
        if fnmatchcase(key, pattern):
            return reason
    return None
