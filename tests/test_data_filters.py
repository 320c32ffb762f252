"""PII redaction and C4's bad-words rule: what they catch, what they must leave alone, in English and Chinese."""

import json
import pickle

import pytest

from helpers import SHARED_DATA
from liandan.config import ConfigError
from liandan.data.documents.corpus import Document
from liandan.data.pipeline.pipeline_config import load_pipeline
from liandan.data.steps.badwords import BadWords, shipped_lists
from liandan.data.steps.base import build_step
from liandan.data.steps.pii import RedactPII

CORPUS = SHARED_DATA / "corpus"


def doc(text, doc_id="d"):
    return Document("test", doc_id, text)


def redacted(text, **options):
    return RedactPII(**options).redact(text)


# --- PII -----------------------------------------------------------------------------------------------------------

# (text, what it must become) in English and Chinese.
FOUND = [
    ("Write to john.doe+news@example.co.uk today.", "Write to <EMAIL> today."),
    ("联系邮箱：zhang.san@qq.com。", "联系邮箱：<EMAIL>。"),
    ("Resolved by 8.8.8.8, then 2001:4860:4860::8888.", "Resolved by <IP_ADDRESS>, then <IP_ADDRESS>."),
    ("服务器地址为114.114.114.114，端口8080。", "服务器地址为<IP_ADDRESS>，端口8080。"),
    ("Call +1 (212) 555-0123 now", "Call <PHONE_NUMBER> now"),
    ("London office: +44 20 7946 0958.", "London office: <PHONE_NUMBER>."),
    ("or 020 7946 0958 from the UK", "or <PHONE_NUMBER> from the UK"),
    ("Toll free 1-800-555-0199, or (212) 555-0123.", "Toll free <PHONE_NUMBER>, or <PHONE_NUMBER>."),
    ("Berlin: +49 (0)30 12345678", "Berlin: <PHONE_NUMBER>"),
    ("电话13800138000，或+86 139 1234 5678。", "电话<PHONE_NUMBER>，或<PHONE_NUMBER>。"),
    ("手机：138-0013-8000；座机：010-12345678", "手机：<PHONE_NUMBER>；座机：<PHONE_NUMBER>"),
    ("深圳（0755）的号码是 (0755) 1234567。", "深圳（0755）的号码是 <PHONE_NUMBER>。"),
]

# Numbers and names that look a little like personal data and are not.
LEFT_ALONE = [
    "Upgrade to version 1.2.3.4 or v2.0.1.7; the release 10.0.19041.1 is older, as is 1.2.3.4.5.",
    "See section 4.3.2.1 and rule 1.1.1.1 of the handbook.",
    "On 2024-01-15 at 10:30:45, and again on 2024.01.15 and 15/01/2024.",
    "Pi is 3.14159265358979; e is 2.718281828459045; 1,234,567.89 dollars.",
    "The war lasted 1939-1945, the range is 100-200, the score 3-2 and ISBN 978-3-16-148410-0.",
    "In C++ write std::vector or a::b; Haskell has foo :: Int -> Int.",
    "Mail user@localhost or ask @someone; the icon is logo@2x.png.",
    "The router answers on 192.168.0.1 and 10.0.0.1 inside the network.",
    "版本 2.10.3.1 发布于 2023年10月12日，第1.2.3.4节有说明。",
    "价格为 1,234,567.89 元，共 12345678901234 条记录，编号 2023-10-12-001。",
    "他生于1949年10月1日，享年88岁，身高1.75米，圆周率约为3.1415926535。",
]


@pytest.mark.parametrize("text,expected", FOUND)
def test_pii_is_replaced_in_english_and_chinese(text, expected):
    assert redacted(text) == expected


@pytest.mark.parametrize("text", LEFT_ALONE)
def test_versions_dates_and_decimals_are_not_pii(text):
    assert redacted(text) == text


def test_pii_counts_documents_and_replacements_per_kind():
    step = RedactPII()
    texts = [FOUND[0][0], FOUND[2][0], FOUND[9][0], "Nothing personal here.", FOUND[0][0] + " " + FOUND[10][0]]
    out = list(step([doc(t, str(i)) for i, t in enumerate(texts)]))
    assert len(out) == 5 and out[3].text == texts[3]
    assert dict(step.stats.changed) == {
        "email": 2,
        "email replacements": 2,
        "ip_address": 1,
        "ip_address replacements": 2,
        "phone_number": 2,
        "phone_number replacements": 4,
    }
    assert step.stats.dropped == {}


def test_pii_options_switch_kinds_and_placeholders():
    text = "mail a@example.com, host 8.8.8.8, router 192.168.0.1, phone 212-555-0123"
    assert redacted(text, ip_addresses=False, phone_numbers=False) == (
        "mail <EMAIL>, host 8.8.8.8, router 192.168.0.1, phone 212-555-0123"
    )
    assert redacted(text, public_ips_only=False, email_placeholder="[email]", phone_placeholder="[phone]") == (
        "mail [email], host <IP_ADDRESS>, router <IP_ADDRESS>, phone [phone]"
    )
    step = build_step({"name": "pii", "emails": False})
    assert step.redact(text) == "mail a@example.com, host <IP_ADDRESS>, router 192.168.0.1, phone <PHONE_NUMBER>"
    assert pickle.loads(pickle.dumps(step)).redact(text) == step.redact(text)  # steps travel to workers pickled
    with pytest.raises(ConfigError, match="step 'pii' has no option 'email'"):
        build_step({"name": "pii", "email": False})


def test_shared_corpora_hold_no_false_positives():
    if not CORPUS.is_dir():
        pytest.skip(f"shared data not found at {CORPUS}")
    texts = [json.loads(line)["text"] for name in ("en-wikitext2.jsonl", "zh-classics.jsonl")
             for line in (CORPUS / name).read_text(encoding="utf-8").splitlines()]  # fmt: skip
    texts.append((CORPUS / "en-shakespeare.txt").read_text(encoding="utf-8"))
    step = RedactPII(public_ips_only=False)
    assert sum(1 for _ in step(doc(t) for t in texts)) == len(texts)
    assert step.stats.changed == {}  # thousands of numbers, years and dates: not one taken for personal data


# --- bad words -------------------------------------------------------------------------------------------------------


def test_bad_words_ship_english_and_chinese_lists():
    assert {"en", "zh"} <= set(shipped_lists())
    step = BadWords()
    assert len(step.lists["en"]) > 350 and len(step.lists["zh"]) > 250


def test_english_words_match_whole_words_only():
    step = BadWords(languages=["en"])
    verdicts = {
        "He called him an ass.": "ass",
        "The CLASS passed the glass to the Assessor.": None,
        "Two girls,\n1 cup": None,  # punctuation breaks the phrase: words must follow each other
        "2 Girls  1\nCup": "2 girls 1 cup",  # any spacing and case inside a phrase
        "the S&M scene": "s&m",
        "S. M. Smith wrote the book.": None,
        "a 🖕 in the margin": "🖕",
        "Sussex is a county; Essex too.": None,
    }
    for text, word in verdicts.items():
        d = doc(text)
        assert step.check(d) == (None if word is None else "bad_words:en"), text
        assert d.meta.get("bad_word") == word


def test_chinese_entries_match_as_substrings():
    step = BadWords(languages=["zh"])
    dropped = doc("他说了一句他妈的就走了。")
    assert step.check(dropped) == "bad_words:zh" and dropped.meta["bad_word"] == "他妈"
    # single characters are left out of substring matching: 性 is in 女性 and 性格, 乳 in 乳燕
    assert step.check(doc("女性的性格温和，乳燕归巢。")) is None
    assert BadWords(languages=["zh"], min_cjk_chars=1).check(doc("女性的性格温和。")) == "bad_words:zh"
    assert step.check(doc("Chapter 13. begins")) is None  # "13." in the list is numbering, not a word


def test_bad_words_options_and_drop_reasons(tmp_path):
    words_file = tmp_path / "mine.txt"
    words_file.write_text("frobnicate\n\n苹果派\n", encoding="utf-8")
    step = BadWords(languages=[], word_files=[str(words_file)], extra_words=["widget"])
    texts = ["We frobnicate daily.", "我爱吃苹果派。", "A widget.", "A clean sentence."]
    kept = [d.text for d in step([doc(t, str(i)) for i, t in enumerate(texts)])]
    assert kept == ["A clean sentence."]
    assert step.stats.dropped == {"bad_words:mine": 2, "bad_words:extra": 1}
    allowing = BadWords(languages=["en"], allow_words=["ASS"])
    assert allowing.check(doc("an ass")) is None and allowing.check(doc("xxx")) == "bad_words:en"
    with pytest.raises(ConfigError, match="no shipped word list for language 'xx'"):
        build_step({"name": "bad_words", "languages": ["xx"]})
    with pytest.raises(ConfigError, match="word file not found"):
        build_step({"name": "bad_words", "word_files": [str(tmp_path / "missing.txt")]})
    with pytest.raises(ConfigError, match="no word list"):
        build_step({"name": "bad_words", "languages": []})


def test_pipeline_file_selects_the_new_steps_with_relative_word_files(tmp_path):
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "extra.txt").write_text("frobnicate\n", encoding="utf-8")
    (tmp_path / "pipe.toml").write_text(
        '[[inputs]]\nname = "web"\npaths = ["raw.jsonl"]\nlanguages = ["en"]\n'
        '[[steps]]\nname = "pii"\n'
        '[[steps]]\nname = "bad_words"\nword_files = ["lists/extra.txt"]\n',
        encoding="utf-8",
    )
    cfg = load_pipeline(tmp_path / "pipe.toml")
    assert cfg.steps[1]["word_files"] == [str(tmp_path / "lists" / "extra.txt")]
    assert cfg.inputs[0].languages == ["en"]
    step = build_step(cfg.steps[1])
    assert step.check(doc("they frobnicate")) == "bad_words:extra"
