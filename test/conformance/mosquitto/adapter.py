
# --- Keel: appended to the suite's mosq_test.py by run.sh -------------------
#
# The suite reads exactly as many bytes as the packet it expects and compares
# them with what one broker writes. These definitions replace its readers and
# comparator so that two packets that mean the same under the specification
# compare equal:
#
#   - packets are read whole (fixed header, remaining length, body), so a
#     longer packet than expected is reported as such, not half read;
#   - MQTT 5 properties compare in a canonical order: the order of properties
#     other than User Properties carries no meaning (MQTT 5.0 section 2.2.2);
#     User Properties keep their order among themselves ([MQTT-3.3.2-18]);
#   - Reason Strings are left out: they are free text for diagnostics
#     (section 3.4.2.2.2), and a server may send one or not;
#   - of several packets expected together, packets of different types may
#     come in any order (a PUBACK to a client and a PUBLISH to the same
#     client are not ordered by the specification); packets of one type keep
#     their order;
#   - PUBLISH packets that come before an expected SUBACK are kept for the
#     reads after it: the server may send matching messages (retained ones)
#     before the SUBACK (3.1.1 and 5.0 section 3.8.4);
#   - where the test expects the connection closed, an MQTT 5 CONNACK or
#     DISCONNECT with an error Reason Code (0x80 or above) and then the close
#     is accepted: on a Malformed Packet or Protocol Error the server MAY
#     send one before closing ([MQTT-4.13.1-1], section 4.13.2).
#
# Nothing else is relaxed: packet identifiers, flags, reason codes, topics,
# payloads and property values must match byte for byte. A packet that does
# not parse as MQTT 5 is compared as it came.

_PROP_SIZE = {0x01: 1, 0x02: 4, 0x11: 4, 0x13: 2, 0x17: 1, 0x18: 4, 0x19: 1,
              0x21: 2, 0x22: 2, 0x23: 2, 0x24: 1, 0x25: 1, 0x27: 4, 0x28: 1,
              0x29: 1, 0x2A: 1}
_PROP_STR = (0x03, 0x08, 0x09, 0x12, 0x15, 0x16, 0x1A, 0x1C, 0x1F)


def _varint(buf, i):
    value, mult = 0, 1
    for _ in range(4):
        if i >= len(buf):
            return None, i
        b = buf[i]
        i += 1
        value += (b & 127) * mult
        mult *= 128
        if b & 128 == 0:
            return value, i
    return None, i


def _encode_varint(n):
    out = b''
    while True:
        b = n % 128
        n //= 128
        if n:
            out += bytes([b | 128])
        else:
            return out + bytes([b])


def _canonical_props(props):
    """The properties in canonical order without Reason Strings, or None."""
    others, users = [], []
    i = 0
    while i < len(props):
        start = i
        pid = props[i]
        i += 1
        if pid in _PROP_SIZE:
            i += _PROP_SIZE[pid]
        elif pid in _PROP_STR:
            if i + 2 > len(props):
                return None
            i += 2 + struct.unpack('!H', props[i:i+2])[0]
        elif pid == 0x26:
            for _ in range(2):
                if i + 2 > len(props):
                    return None
                i += 2 + struct.unpack('!H', props[i:i+2])[0]
        elif pid == 0x0B:
            _, i = _varint(props, i)
        else:
            return None
        if i > len(props):
            return None
        item = props[start:i]
        if pid == 0x26:
            users.append(item)
        elif pid != 0x1F:
            others.append(item)
    return b''.join(sorted(others)) + b''.join(users)


def _canonical_reason(body, at):
    """The body of an ack (at 2, after the packet identifier) or of a
    DISCONNECT or AUTH (at 0): its Reason Code at at, then its properties,
    in the shortest form that says the same; None if it does not parse."""
    code = body[at]
    props = b''
    if len(body) > at + 1:
        n, start = _varint(body, at + 1)
        if n is None or start + n != len(body):
            return None
        props = _canonical_props(body[start:])
        if props is None:
            return None
    if props:
        return body[:at+1] + _encode_varint(len(props)) + props
    if code == 0:
        return body[:at]
    return body[:at+1]


def _canonical(packet):
    """packet (one whole packet) in canonical MQTT 5 form, or as it is."""
    if len(packet) < 2:
        return packet
    rl, body_at = _varint(packet, 1)
    if rl is None or body_at + rl != len(packet):
        return packet
    kind = packet[0] & 0xF0
    body = packet[body_at:]
    try:
        if kind == 0x20 and len(body) >= 3:  # CONNACK: flags, code, props
            head, rest = body[:2], body[2:]
            n, at = _varint(rest, 0)
            if n is None or at + n != len(rest):
                return packet
            props = _canonical_props(rest[at:])
            if props is None:
                return packet
            body = head + _encode_varint(len(props)) + props
        elif kind in (0x40, 0x50, 0x60, 0x70) and len(body) >= 3:  # acks
            body = _canonical_reason(body, 2)
        elif kind in (0xE0, 0xF0) and len(body) >= 1:  # DISCONNECT, AUTH
            body = _canonical_reason(body, 0)
        elif kind == 0x30 and len(body) >= 3:  # PUBLISH
            qos = (packet[0] >> 1) & 3
            at = 2 + struct.unpack('!H', body[:2])[0] + (2 if qos else 0)
            n, pat = _varint(body, at)
            if n is None or pat + n > len(body):
                return packet
            props = _canonical_props(body[pat:pat+n])
            if props is None or len(props) != n:
                return packet
            body = body[:pat] + props + body[pat+n:]
        elif kind in (0x90, 0xB0) and len(body) >= 3:  # SUBACK, UNSUBACK
            n, at = _varint(body, 2)
            if n is None or at + n > len(body):
                return packet
            props = _canonical_props(body[at:at+n])
            if props is None:
                return packet
            body = body[:2] + _encode_varint(len(props)) + props + body[at+n:]
        else:
            return packet
    except struct.error:
        return packet
    if body is None:
        return packet
    return bytes([packet[0]]) + _encode_varint(len(body)) + body


def _split(packets):
    """packets (several whole packets back to back) as a list."""
    out = []
    while packets:
        rl, at = _varint(packets, 1)
        if rl is None or at + rl > len(packets):
            out.append(packets)
            break
        out.append(packets[:at+rl])
        packets = packets[at+rl:]
    return out


# Packets read ahead of what a test asked for, per socket (see expect_packet).
_ahead = {}


def read_packet(sock):
    """One whole packet from sock; b'' if the connection ends first."""
    kept = _ahead.get(id(sock))
    if kept:
        return kept.pop(0)
    return _read_fresh(sock)


def _read_fresh(sock):
    """One whole packet from sock itself, past those read ahead."""
    first = sock.recv(1)
    if len(first) == 0:
        return b''
    return _read_rest(sock, first)


def _read_rest(sock, first):
    """The packet whose first byte is first, read whole from sock; short if
    the connection ends first."""
    header = first
    for _ in range(4):
        b = sock.recv(1)
        if len(b) == 0:
            return header
        header += b
        if b[0] & 128 == 0:
            break
    rl, _ = _varint(header, 1)
    body = b''
    while rl is not None and len(body) < rl:
        chunk = sock.recv(rl - len(body))
        if len(chunk) == 0:
            break
        body += chunk
    return header + body


def _same(recvd, expected):
    if recvd == expected:
        return True
    got, want = _split(recvd), _split(expected)
    if len(got) != len(want):
        return False
    got = [_canonical(p) for p in got]
    want = [_canonical(p) for p in want]
    for kind in set(p[0] & 0xF0 for p in got + want):
        if [p for p in got if p[0] & 0xF0 == kind] != [p for p in want if p[0] & 0xF0 == kind]:
            return False
    return True


def packet_matches(name, recvd, expected):
    if _same(recvd, expected):
        return True
    print("FAIL: Received incorrect "+name+".")
    for label, packet in (("Received", recvd), ("Expected", expected)):
        try:
            print(label+": "+to_string(packet))
        except (struct.error, TypeError, IndexError):
            print(label+" (not decoded, len=%d): %s" % (len(packet), packet))
    return False


def _closed_after_error(sock, first):
    """Whether first (a packet's first byte) begins an MQTT 5 CONNACK or
    DISCONNECT with an error Reason Code after which the server closes."""
    if first[0] not in (0x20, 0xE0):
        return False
    packet = _read_rest(sock, first)
    rl, at = _varint(packet, 1)
    if rl is None or at + rl != len(packet):
        return False
    body = packet[at:]
    if first[0] == 0x20:
        if len(body) < 3:  # an MQTT 3 CONNACK: 3.1.1 closes without one
            return False
        code = body[1]
    else:
        if len(body) < 1:
            return False
        code = body[0]
    if code < 0x80:
        return False
    try:
        return sock.recv(1) == b''
    except OSError:
        return True


def expect_packet(sock, name, expected):
    if len(expected) == 0:
        recvd = sock.recv(1)
        if recvd and _closed_after_error(sock, recvd):
            recvd = b''
    else:
        want = _split(expected)
        got = []
        for p in want:
            r = read_packet(sock)
            # PUBLISHes that come before an expected SUBACK (section 3.8.4).
            while p[0] == 0x90 and r and r[0] & 0xF0 == 0x30:
                _ahead.setdefault(id(sock), []).append(r)
                r = _read_fresh(sock)
            got.append(r)
        recvd = b''.join(got)
    if packet_matches(name, recvd, expected):
        return True
    raise TestError


def receive_unordered(sock, recv1_packet, recv2_packet, error_string):
    recvd = read_packet(sock)
    recvd += read_packet(sock)
    if _same(recvd, recv1_packet + recv2_packet) or _same(recvd, recv2_packet + recv1_packet):
        return
    packet_matches(error_string, recvd, recv1_packet + recv2_packet)
    raise ValueError(error_string)
