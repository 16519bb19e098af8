#!/usr/bin/env bash
# The whole test suite, from a fresh clone on a bare machine. Installs what the tests need:
# the Python dependencies (into ./.venv, PySpark and matplotlib included), a Redis server (Debian's
# redis-server, when missing), Java (Debian's default-jre-headless, when missing) for the Spark job's tests, iproute2,
# Node.js and npm (Debian's nodejs and npm, when missing) and rhea (+ minimist) for the Node client tests
# (`npm ci` in clients/node, from its package-lock.json; see etc/bootstrap.sh), and RabbitMQ (Debian's
# rabbitmq-server, when missing; its service is not started: the tests run their own node on loopback), and
# Debian's chromium and chromium-driver (when missing) for the dashboard's browser test, and Debian's zookeeper
# (when missing; its service is not started: the tests run their own servers on loopback) for the HA pairs
# coordinated by ZooKeeper.
# Extra arguments go to pytest (e.g. `bash etc/run-tests.sh tests/unit -x`).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)
command -v ip >/dev/null 2>&1 || need+=(iproute2)   # network namespaces for the multicast discovery tests
command -v java >/dev/null 2>&1 || need+=(default-jre-headless)   # PySpark's JVM (Debian 12: OpenJDK 17) for tests/spark
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || need+=(rabbitmq-server)   # a third-party AMQP 1.0 peer (tests/rabbitproc.py)
[ -x /usr/bin/chromium ] || need+=(chromium)                  # the dashboard in a real browser (selenium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
[ -f /usr/share/java/zookeeper.jar ] || need+=(zookeeper)      # [ha.manager] (tests/zkproc.py)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
fi
bash "$repo/etc/bootstrap.sh" test
cd "$repo"
exec "$repo/.venv/bin/python" -m pytest "$@"
