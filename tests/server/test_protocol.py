"""Server pieces without HTTP: chat templates, request parsing, header checks. (Stream deltas are the
engine's: tests/engine/test_detokenize.py.)"""

from __future__ import annotations

import pytest

from gptoss_lite.server import protocol as P
from gptoss_lite.server.chat import BYTE_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError


def test_byte_template_is_the_documented_transcript():
    """The byte model's template: 'Role: content' lines, then 'Assistant:'."""
    t = ChatTemplate(None)
    assert t.source == BYTE_CHAT_TEMPLATE and t.is_default
    text = t.render([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}])
    assert text == "System: Be terse.\nUser: Hi\nAssistant:"


def test_hf_style_template_renders_and_can_refuse():
    """A checkpoint's template renders with transformers' helpers (trim_blocks, tojson, bos_token);
    its raise_exception becomes a ChatTemplateError (a 400 in the API)."""
    source = (
        "{{ bos_token }}{% for m in messages %}\n"
        "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system must come first') }}{% endif %}\n"
        "<|{{ m['role'] }}|>{{ m['content'] | tojson }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    t = ChatTemplate(source, bos_token="<s>")
    assert (
        t.render([{"role": "user", "content": "né"}]) == '<s><|user|>"né"\n<|assistant|>'
    )  # trim_blocks ate the newlines after the tags
    with pytest.raises(ChatTemplateError, match="system must come first"):
        t.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_parse_request_names_the_field():
    """Strict parsing: the first bad field is named; a valid body parses to the model."""
    req = P.parse_request(P.CompletionRequest, b'{"model": "m", "prompt": [1, 2], "stop": "x"}')
    assert req.single_prompt() == [1, 2] and req.stop_strings() == ("x",) and req.max_tokens == 16
    with pytest.raises(P.APIError, match="top_p") as err:
        P.parse_request(P.CompletionRequest, b'{"model": "m", "prompt": "a", "top_p": 2}')
    assert err.value.status == 400 and err.value.param == "top_p"
