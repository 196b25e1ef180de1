'use strict'
// nsqjs 0.13.0's Reader given only lookupd addresses (lookupdHTTPAddresses): finds the nodes of a
// topic and reads them all. Same request and result as pynsq_lookupd_reader.py: lookupd_http,
// topic, channel, count, quiet_s, deadline_s on stdin; received, connected, errors on stdout.

const nsq = require('nsqjs')

const result = {received: [], connected: [], errors: []}

function readStdin() {
  return new Promise((resolve, reject) => {
    const chunks = []
    process.stdin.on('data', (c) => chunks.push(c))
    process.stdin.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')))
    process.stdin.on('error', reject)
  })
}

async function main() {
  const request = JSON.parse(await readStdin())
  const reader = new nsq.Reader(request.topic, request.channel, {
    lookupdHTTPAddresses: request.lookupd_http,
    maxInFlight: 30,
  })
  const connected = new Set()
  reader.on('nsqd_connected', (host, port) => connected.add(`${host}:${port}`))
  reader.on('error', (err) => result.errors.push(String(err)))
  reader.on('message', (msg) => {
    result.received.push({body: msg.body.toString('base64'), attempts: msg.attempts, id: msg.id})
    msg.finish()
  })
  reader.connect()
  const started = Date.now()
  let fullSince = null
  await new Promise((resolve) => {
    const timer = setInterval(() => {
      if (result.received.length >= request.count && fullSince === null) fullSince = Date.now()
      const late = Date.now() - started > request.deadline_s * 1000
      if (late || (fullSince !== null && Date.now() - fullSince >= request.quiet_s * 1000)) {
        if (late) result.errors.push('deadline passed')
        clearInterval(timer)
        resolve()
      }
    }, 20)
  })
  result.connected = Array.from(connected).sort()
  process.stdout.write(JSON.stringify(result) + '\n')
  reader.close()
  setTimeout(() => process.exit(0), 200)
}

main().catch((err) => {
  result.errors.push(String(err && err.stack ? err.stack : err))
  process.stdout.write(JSON.stringify(result) + '\n')
  process.exit(0)
})
