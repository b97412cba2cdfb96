"""A strict HTTP/1.1 upstream for the proxy's differential test.

It parses with h11, an implementation independent of the proxy's (hyper),
and logs, one JSON object a line on stdout, every connection it accepts,
every request it parses (method, target, body length) and every protocol
error it meets, then answers each request with that request as JSON. Its
first line is the port it listens on (127.0.0.1 only). It runs until its
standard input closes.
"""

import json
import socket
import sys
import threading

import h11

LOCK = threading.Lock()


def log(entry):
    with LOCK:
        sys.stdout.write(json.dumps(entry) + "\n")
        sys.stdout.flush()


def serve(sock, number):
    conn = h11.Connection(h11.SERVER)
    log({"conn": number, "event": "open"})
    request, length = None, 0
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = sock.recv(65536)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                request, length = event, 0
            elif isinstance(event, h11.Data):
                length += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                seen = {
                    "conn": number,
                    "event": "request",
                    "method": request.method.decode("latin-1"),
                    "target": request.target.decode("latin-1"),
                    "body": length,
                }
                log(seen)
                body = json.dumps(seen).encode()
                headers = [("content-length", str(len(body))), ("content-type", "application/json")]
                sock.sendall(conn.send(h11.Response(status_code=200, headers=headers)))
                if request.method != b"HEAD":
                    sock.sendall(conn.send(h11.Data(data=body)))
                sock.sendall(conn.send(h11.EndOfMessage()))
                if conn.our_state is h11.MUST_CLOSE:
                    break
                conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                break
    except h11.RemoteProtocolError as e:
        log({"conn": number, "event": "error", "error": str(e)})
    except OSError:
        pass
    finally:
        try:
            sock.close()
        finally:
            log({"conn": number, "event": "closed"})


def main():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    log({"port": listener.getsockname()[1]})

    def accept():
        number = 0
        while True:
            sock, _ = listener.accept()
            threading.Thread(target=serve, args=(sock, number), daemon=True).start()
            number += 1

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.read()


if __name__ == "__main__":
    main()
