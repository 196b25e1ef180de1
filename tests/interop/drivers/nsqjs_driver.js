'use strict'
// Interop driver for nsqjs 0.13.0 (node). Runs with NODE_PATH=.interop/node/node_modules.
//
// Same request/result protocol and scenarios as drivers/driver_common.py: one JSON request on
// stdin, one JSON result on stdout.
// Offered by nsqjs and exercised: Writer.publish (PUB, and MPUB when given an array),
// Writer.deferPublish (DPUB), Reader with finish / requeue / touch, messageTimeout (IDENTIFY
// msg_timeout), deflate, snappy, #ephemeral channels.
// Not offered: nsqjs has no HTTP publisher (http_pub / http_mpub are not run for it).

const nsq = require('nsqjs')

const t0 = process.hrtime.bigint()
const now = () => Math.round(Number(process.hrtime.bigint() - t0) / 1e5) / 1e4
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

const result = {received: [], events: [], errors: [], info: {}}
let closing = false
let emitted = false
function emit() {
  if (emitted) return
  emitted = true
  process.stdout.write(JSON.stringify(result) + '\n')
}
const event = (name, extra = {}) => result.events.push({name, t: now(), ...extra})
const error = (text) => {
  if (!closing) result.errors.push(String(text))
}

class ScenarioTimeout extends Error {}

function readStdin() {
  return new Promise((resolve, reject) => {
    const chunks = []
    process.stdin.on('data', (c) => chunks.push(c))
    process.stdin.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')))
    process.stdin.on('error', reject)
  })
}

function hostPort(address) {
  const i = address.lastIndexOf(':')
  return [address.slice(0, i), Number(address.slice(i + 1))]
}

function compressionName(conn) {
  if (!conn) return null
  return conn.deflater ? conn.deflater.constructor.name : 'none'
}

async function main() {
  const request = JSON.parse(await readStdin())
  const defaults = {deadline_s: 15, quiet_s: 1.5, hold_s: 2.0, touch_every_s: 0.3, defer_ms: 500, msg_timeout_ms: 1000}
  for (const [k, v] of Object.entries(defaults)) if (request[k] === undefined) request[k] = v
  const bodies = (request.bodies || []).map((b) => Buffer.from(b, 'base64'))
  const scenario = request.scenario
  const deadline = Date.now() + request.deadline_s * 1000
  const remaining = () => Math.max(0, deadline - Date.now())
  const watchdog = setTimeout(() => {
    result.errors.push('driver watchdog: the scenario did not finish in time (client hung)')
    emit()
    process.exit(3)
  }, request.deadline_s * 1000 + 2000)

  const compression = scenario === 'deflate' || scenario === 'snappy' ? scenario : null
  const wantsTimeout = ['fin', 'touch', 'timeout'].includes(scenario)
  const connOptions = {}
  if (compression === 'deflate') Object.assign(connOptions, {deflate: true, deflateLevel: 6})
  if (compression === 'snappy') connOptions.snappy = true

  // ---- consumer
  const queue = []
  let waiter = null
  const reader = new nsq.Reader(request.topic, request.channel, {
    nsqdTCPAddresses: [request.tcp],
    maxInFlight: 1,
    maxAttempts: 0,
    requeueDelay: 0,
    ...(wantsTimeout ? {messageTimeout: request.msg_timeout_ms} : {}),
    ...connOptions,
  })
  reader.on('message', (m) => {
    queue.push(m)
    if (waiter) waiter()
  })
  reader.on('error', (e) => error(`nsqjs reader error: ${e && e.message ? e.message : e}`))
  const readerReady = new Promise((resolve) => reader.on('ready', resolve))
  reader.connect()

  // ---- producer
  const [host, port] = hostPort(request.tcp)
  let writer = null
  async function getWriter() {
    if (writer) return writer
    writer = new nsq.Writer(host, port, connOptions)
    writer.on('error', (e) => error(`nsqjs writer error: ${e && e.message ? e.message : e}`))
    const ready = new Promise((resolve) => writer.on('ready', resolve))
    writer.connect()
    await withDeadline(ready, 'the Writer connection')
    return writer
  }

  function withDeadline(promise, what) {
    return Promise.race([
      promise,
      sleep(remaining()).then(() => {
        throw new ScenarioTimeout(`timed out waiting for ${what}`)
      }),
    ])
  }

  function callbackPromise(fn) {
    return new Promise((resolve, reject) => fn((err) => (err ? reject(err) : resolve())))
  }

  async function nextMessage(limitMs = null) {
    const budget = limitMs === null ? remaining() : Math.min(limitMs, remaining())
    const end = Date.now() + budget
    while (queue.length === 0) {
      const left = end - Date.now()
      if (left <= 0) {
        if (limitMs === null) throw new ScenarioTimeout(`no message within the deadline (${result.received.length} received)`)
        return null
      }
      await new Promise((resolve) => {
        waiter = resolve
        setTimeout(resolve, left)
      })
      waiter = null
    }
    const m = queue.shift()
    result.received.push({body: m.body.toString('base64'), attempts: m.attempts, id: String(m.id), t: now()})
    return m
  }

  async function quietWindow() {
    const end = Date.now() + request.quiet_s * 1000
    while (Date.now() < end) {
      const extra = await nextMessage(end - Date.now())
      if (extra) {
        event('unexpected_delivery')
        extra.finish()
      }
    }
  }

  try {
    await withDeadline(readerReady, 'the Reader to subscribe')
    event('subscribed')

    const w = await getWriter()
    if (scenario === 'mpub') {
      await callbackPromise((cb) => w.publish(request.topic, bodies, cb))
    } else if (scenario === 'dpub') {
      // nsqjs 0.13.0 quirk: deferPublish needs a one-element array (a bare Buffer throws
      // "Expect an array of messages to produceMessages" inside the connection state machine).
      await callbackPromise((cb) => w.deferPublish(request.topic, [bodies[0]], request.defer_ms, cb))
      event('dpub_acked')
      for (const body of bodies.slice(1)) await callbackPromise((cb) => w.publish(request.topic, body, cb))
    } else if (scenario === 'http_pub' || scenario === 'http_mpub') {
      throw new Error('nsqjs has no HTTP publisher')
    } else {
      for (const body of bodies) await callbackPromise((cb) => w.publish(request.topic, body, cb))
    }
    event('published')

    if (scenario === 'req') {
      const first = await nextMessage()
      first.requeue(0, false)
      event('req_sent')
      ;(await nextMessage()).finish()
    } else if (scenario === 'timeout') {
      await nextMessage()
      event('holding_without_answer')
      ;(await nextMessage()).finish()
    } else if (scenario === 'touch') {
      const held = await nextMessage()
      const end = Date.now() + request.hold_s * 1000
      while (Date.now() < end) {
        const extra = await nextMessage(Math.min(request.touch_every_s * 1000, end - Date.now()))
        if (extra) event('unexpected_delivery')
        held.touch()
        event('touch_sent')
      }
      held.finish()
      event('fin_sent')
      await quietWindow()
    } else {
      for (let i = 0; i < bodies.length; i++) (await nextMessage()).finish()
      if (scenario === 'fin') {
        event('fin_sent')
        await quietWindow()
      }
    }

    const rdyConns = (reader.readerRdy && reader.readerRdy.connections) || []
    const readerConn = rdyConns.length ? rdyConns[0].conn || rdyConns[0] : null
    result.info.compression = {
      producer: writer ? compressionName(writer.conn) : null,
      consumer: compressionName(readerConn),
    }
    await sleep(50)
  } catch (e) {
    result.errors.push(e && e.stack ? e.stack : String(e))
  } finally {
    closing = true
    try {
      reader.close()
      if (writer) writer.close()
    } catch (e) {
      result.errors.push(String(e))
    }
    clearTimeout(watchdog)
    emit()
    setTimeout(() => process.exit(0), 100)
  }
}

main()
