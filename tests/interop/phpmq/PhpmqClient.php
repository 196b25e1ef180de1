<?php
/*
 * A PHPMQ client in plain PHP streams, as a PHP service talks to a PHPMQ server. Written for
 * polymq's interop tests from the protocol's description (docs/protocols/phpmq.md); it speaks
 * both generations: the pinned one reads deliveries of exactly 3 packets (as the published client
 * does, taking the count from its own table), the current one 4 (the remaining TTL).
 */
declare(strict_types=1);

final class PhpmqClient
{
    /** @var resource */
    private $stream;
    private string $buffer = '';

    public function __construct(string $host, int $port, private bool $current = false, float $timeout = 5.0)
    {
        $stream = stream_socket_client("tcp://{$host}:{$port}", $errno, $errstr, $timeout);
        if ($stream === false) {
            throw new RuntimeException("cannot connect to {$host}:{$port}: {$errstr}");
        }
        stream_set_timeout($stream, (int) $timeout);
        $this->stream = $stream;
    }

    private static function packet(int $type, string $content): string
    {
        return sprintf('P%02d%029d', $type, strlen($content)) . $content;
    }

    /** @param list<array{int, string}> $packets */
    private function message(int $type, array $packets): void
    {
        $data = sprintf('H%02d%03d%02d', 1, $type, count($packets));
        foreach ($packets as [$packetType, $content]) {
            $data .= self::packet($packetType, $content);
        }
        while ($data !== '') {
            $written = fwrite($this->stream, $data);
            if ($written === false || $written === 0) {
                throw new RuntimeException('write failed');
            }
            $data = substr($data, $written);
        }
    }

    public function send(string $queue, string $content, ?int $ttl = null): void
    {
        $packets = [[1, $queue], [2, $content]];
        if ($ttl !== null) {
            $packets[] = [5, (string) $ttl];
        }
        $this->message(1, $packets);
    }

    public function consume(string $queue, int $count): void
    {
        $this->message(2, [[1, $queue], [4, (string) $count]]);
    }

    public function ack(string $queue, string $id): void
    {
        $this->message(4, [[1, $queue], [3, $id]]);
    }

    public function requeue(string $queue, string $id, int $ttl): void
    {
        $this->message(5, [[1, $queue], [3, $id], [5, (string) $ttl]]);
    }

    public function deadLetter(string $queue, string $id): void
    {
        $this->message(6, [[1, $queue], [3, $id]]);
    }

    private function read(int $length): string
    {
        while (strlen($this->buffer) < $length) {
            $chunk = fread($this->stream, 65536);
            if ($chunk === false || $chunk === '') {
                if (stream_get_meta_data($this->stream)['timed_out']) {
                    throw new RuntimeException('timed out waiting for the server');
                }
                if (feof($this->stream)) {
                    throw new RuntimeException('the server closed the connection');
                }
                continue;
            }
            $this->buffer .= $chunk;
        }
        $out = substr($this->buffer, 0, $length);
        $this->buffer = substr($this->buffer, $length);
        return $out;
    }

    /** @return array{queue: string, content: string, id: string, ttl: int|null} */
    public function receive(): array
    {
        $header = $this->read(8);
        if ($header[0] !== 'H' || substr($header, 3, 3) !== '003') {
            throw new RuntimeException("not a delivery: {$header}");
        }
        $expected = $this->current ? 4 : 3;
        $count = (int) substr($header, 6, 2);
        if ($count !== $expected) {
            throw new RuntimeException("a delivery of {$count} packets; this client reads {$expected}");
        }
        $packets = [];
        for ($i = 0; $i < $count; $i++) {
            $packetHeader = $this->read(32);
            $packets[(int) substr($packetHeader, 1, 2)] = $this->read((int) substr($packetHeader, 3));
        }
        return [
            'queue' => $packets[1],
            'content' => $packets[2],
            'id' => $packets[3],
            'ttl' => isset($packets[5]) ? (int) $packets[5] : null,
        ];
    }

    public function close(): void
    {
        fclose($this->stream);
    }
}
