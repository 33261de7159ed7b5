"""The batch file format: parsing each line into a request or an error record, duplicate
custom_ids, blank lines, the output records' shape, and writing them in input order."""

from __future__ import annotations

import io
import json

import pytest

from cluster.cli.batch_file import (
    DUPLICATE_CUSTOM_ID,
    INVALID_JSON_LINE,
    INVALID_METHOD,
    INVALID_PARAMETER,
    INVALID_URL,
    MISSING_REQUIRED_PARAMETER,
    SUPPORTED_URLS,
    BatchRequest,
    LineError,
    LineParser,
    OrderedWriter,
    count_requests,
    error_record,
    line_error_record,
    numbered_lines,
    parse_line,
    result_record,
)


def _line(**fields: object) -> str:
    doc = {"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    doc.update(fields)
    return json.dumps({k: v for k, v in doc.items() if v is not ...})


@pytest.mark.parametrize("url", SUPPORTED_URLS)
def test_a_good_line_is_a_request(url: str) -> None:
    got = parse_line(_line(url=url, body={"prompt": "hi", "max_tokens": 3}), 7)
    assert got == BatchRequest(7, "r1", url, {"prompt": "hi", "max_tokens": 3})


@pytest.mark.parametrize(
    ("text", "code", "custom_id", "words"),
    [
        ("{not json", INVALID_JSON_LINE, None, "not valid JSON"),
        ("[1, 2]", INVALID_JSON_LINE, None, "not a JSON object"),
        (_line(custom_id=...), MISSING_REQUIRED_PARAMETER, None, "missing custom_id"),
        (_line(method=..., body=...), MISSING_REQUIRED_PARAMETER, "r1", "missing method, body"),
        (_line(url=None), MISSING_REQUIRED_PARAMETER, "r1", "missing url"),
        (_line(custom_id=5), INVALID_PARAMETER, None, "custom_id must be a non-empty string"),
        (_line(custom_id=""), INVALID_PARAMETER, None, "custom_id must be a non-empty string"),
        (_line(method="GET"), INVALID_METHOD, "r1", "only POST"),
        (_line(url="/v1/moderations"), INVALID_URL, "r1", "'/v1/moderations' is not supported"),
        (_line(url="/tokenize"), INVALID_URL, "r1", "/v1/chat/completions"),
        (_line(body="prompt"), INVALID_PARAMETER, "r1", "body must be a JSON object, got str"),
        (_line(body={"prompt": "x", "stream": True}), INVALID_PARAMETER, "r1", "body.stream"),
    ],
)
def test_a_bad_line_is_an_error_naming_the_line_and_field(
    text: str, code: str, custom_id: str | None, words: str
) -> None:
    got = parse_line(text, 3)
    assert isinstance(got, LineError), got
    assert (got.line, got.code, got.custom_id) == (3, code, custom_id)
    assert got.message.startswith("line 3: ") and words in got.message, got.message


def test_stream_false_is_fine() -> None:
    assert isinstance(parse_line(_line(body={"prompt": "x", "stream": False}), 1), BatchRequest)


def test_the_first_line_with_a_custom_id_keeps_it_later_ones_are_duplicates() -> None:
    parser = LineParser()
    first = parser.parse(_line(custom_id="a"), 1)
    bad = parser.parse(_line(custom_id="b", url="/nope"), 2)
    assert isinstance(first, BatchRequest) and isinstance(bad, LineError)
    again = parser.parse(_line(custom_id="a"), 3)
    # A bad line uses its custom_id up too: every custom_id names one record's outcome.
    again_b = parser.parse(_line(custom_id="b"), 4)
    for got, cid, line in ((again, "a", 3), (again_b, "b", 4)):
        assert isinstance(got, LineError) and got.code == DUPLICATE_CUSTOM_ID
        assert got.custom_id == cid and got.message.startswith(f"line {line}: ")
    assert isinstance(parser.parse(_line(custom_id="c"), 5), BatchRequest)
    # Lines with no usable custom_id never collide with each other.
    assert parser.parse("{bad", 6).code == parser.parse("{bad", 7).code == INVALID_JSON_LINE


def test_blank_lines_get_no_record_and_line_numbers_stay_physical() -> None:
    text = "a\n\n   \nb\r\n\tc\t\n"
    assert list(numbered_lines(io.StringIO(text))) == [(1, "a"), (4, "b"), (5, "c")]
    assert count_requests(io.StringIO(text)) == 3
    assert count_requests(io.StringIO("")) == 0


def test_records_have_openais_fields() -> None:
    ok = result_record("r1", 200, "req-1", {"object": "text_completion"})
    assert list(ok) == ["id", "custom_id", "response", "error"]
    assert ok["id"].startswith("batch_req_") and ok["custom_id"] == "r1" and ok["error"] is None
    assert ok["response"] == {
        "status_code": 200,
        "request_id": "req-1",
        "body": {"object": "text_completion"},
    }
    err = error_record(None, INVALID_JSON_LINE, "line 2: not valid JSON")
    assert list(err) == ["id", "custom_id", "response", "error"]
    assert err["custom_id"] is None and err["response"] is None
    assert err["error"] == {"code": INVALID_JSON_LINE, "message": "line 2: not valid JSON"}
    assert ok["id"] != result_record("r1", 200, "req-1", {})["id"]  # one id per record
    bad = parse_line(_line(url="/x"), 9)
    assert isinstance(bad, LineError)
    assert line_error_record(bad)["error"]["code"] == INVALID_URL
    assert line_error_record(bad)["custom_id"] == "r1"


class _Flushes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


def test_the_writer_holds_a_record_until_every_earlier_one_is_written() -> None:
    out = _Flushes()
    writer = OrderedWriter(out)
    rec = [error_record(f"r{i}", "x", str(i)) for i in range(5)]
    assert writer.put(2, rec[2]) == 0 and writer.put(1, rec[1]) == 0
    assert out.getvalue() == "" and writer.held == 2 and out.flushes == 0
    assert writer.put(0, rec[0]) == 3  # 0, then the held 1 and 2
    assert (writer.written, writer.held, out.flushes) == (3, 0, 1)
    assert writer.put(4, rec[4]) == 0 and writer.put(3, rec[3]) == 2
    lines = out.getvalue().splitlines()
    assert [json.loads(x)["custom_id"] for x in lines] == ["r0", "r1", "r2", "r3", "r4"]
    assert out.flushes == 2
    with pytest.raises(ValueError):
        writer.put(1, rec[1])


def test_the_writer_keeps_unicode_readable() -> None:
    out = io.StringIO()
    OrderedWriter(out).put(0, result_record("r", 200, "q", {"text": "héllo ✓"}))
    assert "héllo ✓" in out.getvalue() and out.getvalue().endswith("\n")
