#!/usr/bin/env python3
"""Reads TensorBoard event files (TensorFlow's events.out.tfevents.* format: TFRecords, each holding a serialized
tensorflow.Event protobuf) and prints their records, checking both masked CRC-32C checksums of every record.

Usage: read_tfevents.py FILE_OR_DIR [--json]   (standard library only)

A directory means every events.out.tfevents.* file in it, in name order. With --json, every scalar is printed as
{"wall_time", "step", "tag", "value"} and every file_version record as {"file_version", "wall_time", "step"}, one
JSON object a line (a NaN or infinite value is written as Python's json writes it: NaN, Infinity, -Infinity).
A bad checksum or framing exits with status 1 and a line naming the file and the record's index; a last record cut
short (a writer killed mid-write) is a warning on stderr and is skipped.
"""
import json
import os
import struct
import sys


def _crc32c_table():
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data):
    """CRC-32C (Castagnoli) of bytes: crc32c(b"123456789") == 0xE3069283."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data):
    """TensorFlow's masked CRC of a TFRecord's length or data."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class FormatError(Exception):
    pass


def _varint(buf, pos):
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise FormatError("bad varint in protobuf")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def proto_fields(buf):
    """Yields (field number, wire type, value) of a protobuf message: an int for a varint, bytes otherwise."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _varint(buf, pos)
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            value, pos = buf[pos:pos + size], pos + size
        elif wire_type == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise FormatError(f"unsupported protobuf wire type {wire_type}")
        if pos > len(buf):
            raise FormatError("protobuf field runs past its message")
        yield number, wire_type, value


def decode_event(data):
    """A tensorflow.Event as a dict: wall_time, step, and file_version or values [(tag, simple_value)]."""
    event = {"wall_time": 0.0, "step": 0, "values": []}
    for number, wire_type, value in proto_fields(data):
        if number == 1 and wire_type == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif number == 2 and wire_type == 0:
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3 and wire_type == 2:
            event["file_version"] = value.decode("utf-8")
        elif number == 5 and wire_type == 2:
            for summary_field, summary_type, summary_value in proto_fields(value):
                if summary_field != 1 or summary_type != 2:
                    continue
                tag, simple_value = "", None
                for value_field, value_type, item in proto_fields(summary_value):
                    if value_field == 1 and value_type == 2:
                        tag = item.decode("utf-8")
                    elif value_field == 2 and value_type == 5:
                        simple_value = struct.unpack("<f", item)[0]
                if simple_value is not None:
                    event["values"].append((tag, simple_value))
    return event


def read_records(path):
    """The data of each record of a TFRecord file, CRCs checked. Raises FormatError naming the record."""
    with open(path, "rb") as f:
        content = f.read()
    records, pos = [], 0
    while pos < len(content):
        index = len(records)
        header = content[pos:pos + 12]
        if len(header) < 12:
            print(f"warning: {path}: record {index} is cut short (a truncated last record); ignored", file=sys.stderr)
            break
        length_bytes, length_crc = header[:8], struct.unpack("<I", header[8:])[0]
        if masked_crc32c(length_bytes) != length_crc:
            raise FormatError(f"{path}: record {index}: bad length CRC")
        length = struct.unpack("<Q", length_bytes)[0]
        end = pos + 12 + length + 4
        if end > len(content):
            print(f"warning: {path}: record {index} is cut short (a truncated last record); ignored", file=sys.stderr)
            break
        data = content[pos + 12:pos + 12 + length]
        if masked_crc32c(data) != struct.unpack("<I", content[end - 4:end])[0]:
            raise FormatError(f"{path}: record {index}: bad data CRC")
        records.append(data)
        pos = end
    return records


def print_file(path, as_json):
    if not as_json:
        print(f"== {path}")
    for index, data in enumerate(read_records(path)):
        try:
            event = decode_event(data)
        except (FormatError, UnicodeDecodeError, struct.error) as error:
            raise FormatError(f"{path}: record {index}: bad Event protobuf: {error}") from None
        if "file_version" in event:
            if as_json:
                print(json.dumps({"file_version": event["file_version"], "wall_time": event["wall_time"],
                                  "step": event["step"]}))
            else:
                print(f"{index}: wall_time={event['wall_time']!r} file_version={event['file_version']}")
        for tag, value in event["values"]:
            if as_json:
                print(json.dumps({"wall_time": event["wall_time"], "step": event["step"], "tag": tag, "value": value}))
            else:
                print(f"{index}: wall_time={event['wall_time']!r} step={event['step']} {tag}={value!r}")


def main(argv):
    args = [arg for arg in argv[1:] if arg != "--json"]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    target = args[0]
    if os.path.isdir(target):
        paths = [os.path.join(target, name) for name in sorted(os.listdir(target))
                 if name.startswith("events.out.tfevents.")]
    else:
        paths = [target]
    try:
        for path in paths:
            print_file(path, "--json" in argv[1:])
    except FormatError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
