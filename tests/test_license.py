"""The project may be copied and cited: an MIT LICENSE, and a CITATION.cff (Citation File Format 1.2.0) for this
implementation whose preferred citation is the paper, with the title and authors the paper's own source gives."""
import os
import re

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
PAPER = "/work/shared/paper/sddlm_paper.tex"


def read_yaml(text):
    """The block-style YAML subset CITATION.cff uses (mappings, lists of scalars or mappings, quoted or plain
    scalars, comments) -> Python objects; anything else raises ValueError, so a malformed file fails the test."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if "\t" in line[:len(line) - len(line.lstrip())]:
            raise ValueError(f"line {n}: a tab in the indentation")
        rows.append((len(line) - len(line.lstrip()), line.strip(), n))

    def scalar(s, n):
        s = s.strip()
        if s[:1] in "\"'":
            if len(s) < 2 or s[-1] != s[0]:
                raise ValueError(f"line {n}: an unclosed quote")
            return s[1:-1]
        if s[:1] in "[{&*!|>%@`":
            raise ValueError(f"line {n}: {s[:1]!r} is outside the subset this reader knows")
        return int(s) if re.fullmatch(r"-?\d+", s) else s

    def block(i, indent):
        """rows[i:] at `indent` -> (value, next row index)."""
        if rows[i][1].startswith("- "):
            out = []
            while i < len(rows) and rows[i][0] == indent and rows[i][1].startswith("- "):
                col, text, n = rows[i]
                rest = text[2:]
                if re.match(r"[\w-]+:(\s|$)", rest):       # a mapping inside the list item
                    rows[i] = (col + 2, rest, n)
                    value, i = block(i, col + 2)
                else:
                    value, i = scalar(rest, n), i + 1
                out.append(value)
            return out, i
        out = {}
        while i < len(rows) and rows[i][0] == indent:
            _, text, n = rows[i]
            m = re.fullmatch(r"([\w-]+):(?:\s+(.*))?", text)
            if not m:
                raise ValueError(f"line {n}: not 'key: value': {text!r}")
            key, value = m.groups()
            if key in out:
                raise ValueError(f"line {n}: {key} twice")
            if value:
                out[key], i = scalar(value, n), i + 1
            elif i + 1 < len(rows) and rows[i + 1][0] > indent:
                out[key], i = block(i + 1, rows[i + 1][0])
            elif i + 1 < len(rows) and rows[i + 1][0] == indent and rows[i + 1][1].startswith("- "):
                out[key], i = block(i + 1, indent)           # a list at the key's own indentation
            else:
                raise ValueError(f"line {n}: {key} has no value")
        if i < len(rows) and rows[i][0] > indent:
            raise ValueError(f"line {rows[i][2]}: unexpected indentation")
        return out, i
    value, i = block(0, rows[0][0])
    if i != len(rows):
        raise ValueError(f"line {rows[i][2]}: unexpected indentation")
    return value


def paper_title_and_authors():
    tex = open(PAPER).read() if os.path.exists(PAPER) else None
    if tex is None:
        return None, None
    title = re.search(r"\\icmltitle\{([^}]*)\}", tex).group(1)
    authors = re.findall(r"^\\icmlauthor\{([^}]*)\}", tex, flags=re.M)     # not the commented-out ones
    return title, authors


def test_citation_cff_names_this_code_and_prefers_the_paper():
    cff = read_yaml(open(os.path.join(HERE, "CITATION.cff")).read())
    assert {"cff-version", "message", "title", "authors"} <= set(cff)        # the format's required keys
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "MIT"
    assert cff["authors"] == [{"name": "sddlm contributors"}]
    paper = cff["preferred-citation"]
    assert {"type", "title", "authors"} <= set(paper)
    assert "2510.22926" in paper["url"] and any("2510.22926" in i["value"] for i in paper["identifiers"])
    title, authors = paper_title_and_authors()
    if title is not None:                                  # the paper's source, where this machine has it
        assert paper["title"] == title == "Simple Denoising Diffusion Language Models"
        assert [f"{a['given-names']} {a['family-names']}" for a in paper["authors"]] == authors
        assert len(authors) == 11


def test_the_yaml_reader_refuses_what_is_not_yaml():
    import pytest
    for bad in ("a: 1\n  b: 2\n", "a: \"open\n", "a:\n", "a: 1\na: 2\n", "just text\n"):
        with pytest.raises(ValueError):
            read_yaml(bad)
    assert read_yaml("a:\n  - x: 1\n    y: \"two\"\n  - 3\nb: c\n") == {"a": [{"x": 1, "y": "two"}, 3], "b": "c"}


def test_license_is_mit():
    text = open(os.path.join(HERE, "LICENSE")).read()
    assert text.startswith("MIT License\n") and "Copyright (c) 2026 sddlm contributors" in text
    words = " ".join(text.split())
    assert "Permission is hereby granted, free of charge, to any person obtaining a copy" in words
    assert 'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND' in words
