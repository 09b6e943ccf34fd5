#!/bin/sh
# Installed as the suite's ../../src/mosquitto: starts keel-edge where a test
# starts mosquitto. Only tests that run the broker on its defaults are run
# (tests.txt), so the flags here are Mosquitto's defaults in Keel's terms:
# anonymous clients, memory only (no persistence), receive maximum 20, topic
# alias maximum 10, no maximum packet size. Options: -p PORT (the rest of
# mosquitto's flags are ignored).
port=1883
while [ $# -gt 0 ]; do
	case "$1" in
	-p) port=$2; shift 2 ;;
	*) shift ;;
	esac
done
exec "${KEEL_EDGE:?KEEL_EDGE names the keel-edge binary}" --auth.anonymous \
	--mqtt.tcp-addr "127.0.0.1:$port" --mqtt.ws-addr "" --ops.addr "" --cluster.api-addr "" \
	--mqtt.sys-interval 0 --data-dir "" --log.level error \
	--mqtt.receive-maximum 20 --mqtt.topic-alias-maximum 10 --mqtt.max-packet-size 0
