<?php
/*
 * php scenario.php HOST PORT PREFIX HTTP: PHP clients of both generations against a PHPMQ server; prints
 * what they saw as one JSON object, which tests/interop/test_php_client.py asserts exactly. HTTP is
 * the gateway's nsqd-style HTTP API (host:port), whose /stats shows when a disconnect was handled.
 */
declare(strict_types=1);

require __DIR__ . '/PhpmqClient.php';

[, $host, $port, $prefix, $http] = $argv;
$port = (int) $port;
$seen = [];
$open = fn (bool $current = false) => new PhpmqClient($host, $port, $current);
$shown = fn (array $delivery) => [$delivery['content'], $delivery['ttl']];

// A window of 2 over 3 messages; an ack from a second connection frees the holder's slot.
$window = "{$prefix}-window";
$producer = $open();
foreach (['m1', 'm2', 'm3'] as $body) {
    $producer->send($window, $body);
}
$consumer = $open();
$consumer->consume($window, 2);
$first = $consumer->receive();
$second = $consumer->receive();
$seen['window'] = [$shown($first), $shown($second)];
$producer->ack($window, $first['id']);
$third = $consumer->receive();
$seen['after_ack_from_another_connection'] = $shown($third);
$consumer->ack($window, $second['id']);
$consumer->ack($window, $third['id']);
$seen['ids_are_32_hex'] = (bool) preg_match('/^[0-9a-f]{32}$/', $first['id']);

// Disconnect with unacknowledged messages: they come back, same ids, ahead of newer ones.
$held = "{$prefix}-held";
$producer->send($held, 'u1');
$producer->send($held, 'u2');
$leaving = $open();
$leaving->consume($held, 2);
$u1 = $leaving->receive();
$u2 = $leaving->receive();
$leaving->close();
// PHPMQ never answers: the server's /stats shows when it has taken the messages back.
$deadline = microtime(true) + 5.0;
do {
    usleep(10_000);
    $stats = json_decode((string) file_get_contents("http://{$http}/stats?format=json&topic={$held}"), true);
    $inFlight = $stats['topics'][0]['channels'][0]['in_flight_count'] ?? -1;
} while ($inFlight !== 0 && microtime(true) < $deadline);
$producer->send($held, 'u3');
$next = $open();
$next->consume($held, 5);
$again = [$next->receive(), $next->receive(), $next->receive()];
$seen['after_disconnect'] = array_map($shown, $again);
$seen['same_ids_after_disconnect'] = [$again[0]['id'] === $u1['id'], $again[1]['id'] === $u2['id']];
foreach ($again as $delivery) {
    $next->ack($held, $delivery['id']);
}

// The current generation: TTLs, requeue to the tail with a new TTL, dead letters.
$timed = "{$prefix}-ttl";
$current = $open(true);
$current->send($timed, 'short', 1);
$current->send($timed, 'long', 600);
$current->send($timed, 'none');
usleep(1_200_000); // PHPMQ TTLs are whole seconds: let the first run out
$current->consume($timed, 1);
$long = $current->receive();
$seen['ttl_left_after_the_short_one_expired'] = [$long['content'], $long['ttl'] > 590 && $long['ttl'] <= 600];
$current->requeue($timed, $long['id'], 900);
$none = $current->receive();
$seen['behind_the_requeued_one'] = $shown($none);
$current->ack($timed, $none['id']);
$requeued = $current->receive();
$seen['requeued'] = [$shown($requeued), $requeued['id'] === $long['id']];
$current->deadLetter($timed, $requeued['id']);
$reader = $open(); // only consumes: shows no generation, so it gets the pinned form
$reader->consume("{$timed}.dead", 1);
$letter = $reader->receive();
$seen['dead_letter'] = [$letter['queue'], $shown($letter), $letter['id'] === $long['id']];
$reader->ack("{$timed}.dead", $letter['id']);

foreach ([$producer, $consumer, $next, $current, $reader] as $client) {
    $client->close();
}
echo json_encode($seen, JSON_THROW_ON_ERROR), "\n";
