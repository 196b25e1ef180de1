/* ZeroMQ's two loops over frames, in C, for the gateway's pump and the clients (native/zmq_loops.py
   says when they are used).

pyzmq hands Python a Frame object per received frame and takes one Python call per frame sent,
each with its own checks; an eMQP request is six or seven frames. Here one call receives every
message waiting on a socket (each a list of bytes) and one call sends a whole multipart message.

libzmq is the one pyzmq already loaded (its path is given to `load`, found in the process's
maps): nothing is linked at build time, so the module builds with gcc and Python's headers
alone, and one libzmq serves both. The socket is pyzmq's; its handle is used only while pyzmq
says it is open, checked at every call.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>

/* libzmq 4's message: 64 opaque bytes, aligned as zmq.h declares it. */
typedef struct {
    unsigned char opaque[64];
} __attribute__((aligned(8))) zmq_msg_t;

#define ZMQ_DONTWAIT 1
#define ZMQ_SNDMORE 2
#define ZMQ_EVENTS 15
#define ZMQ_POLLIN 1

static int (*msg_init)(zmq_msg_t *);
static int (*msg_recv)(zmq_msg_t *, void *, int);
static int (*msg_close)(zmq_msg_t *);
static void *(*msg_data)(zmq_msg_t *);
static size_t (*msg_size)(const zmq_msg_t *);
static int (*msg_more)(const zmq_msg_t *);
static int (*zsend)(void *, const void *, size_t, int);
static int (*getsockopt_)(void *, int, void *, size_t *);
static int (*zerrno)(void);

static PyObject *zmq_error;     /* zmq.ZMQError, called with an errno */
static PyObject *closed_name;   /* "closed" */

#define SENT 0
#define NOT_TAKEN 1
#define UNROUTABLE 2
#define HOST_UNREACHABLE 113 /* EHOSTUNREACH on Linux: a ROUTER_MANDATORY peer gone */

static PyObject *raise_zmq(int error) {
    PyObject *exc = PyObject_CallFunction(zmq_error, "i", error);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* The libzmq handle of an open pyzmq socket, or NULL with an exception set. */
static void *open_handle(PyObject *sock, PyObject *handle) {
    if (msg_recv == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "zmq_frames: load() was not called");
        return NULL;
    }
    PyObject *closed = PyObject_GetAttr(sock, closed_name);
    if (closed == NULL)
        return NULL;
    int is_closed = PyObject_IsTrue(closed);
    Py_DECREF(closed);
    if (is_closed < 0)
        return NULL;
    if (is_closed) {
        raise_zmq(ENOTSOCK);
        return NULL;
    }
    void *address = PyLong_AsVoidPtr(handle);
    if (address == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "zmq_frames: a null socket handle");
    return address;
}

static PyObject *load(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    /* Already loaded by pyzmq: RTLD_NOLOAD gives that copy, never a second one. */
    void *library = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (library == NULL) {
        PyErr_Format(PyExc_OSError, "zmq_frames: %s is not loaded (%s)", path, dlerror());
        return NULL;
    }
#define SYMBOL(target, name)                                                           \
    do {                                                                               \
        *(void **)(&target) = dlsym(library, name);                                    \
        if (target == NULL) {                                                          \
            PyErr_Format(PyExc_OSError, "zmq_frames: %s has no %s", path, name);       \
            msg_recv = NULL;                                                           \
            return NULL;                                                               \
        }                                                                              \
    } while (0)
    SYMBOL(msg_init, "zmq_msg_init");
    SYMBOL(msg_close, "zmq_msg_close");
    SYMBOL(msg_data, "zmq_msg_data");
    SYMBOL(msg_size, "zmq_msg_size");
    SYMBOL(msg_more, "zmq_msg_more");
    SYMBOL(zsend, "zmq_send");
    SYMBOL(getsockopt_, "zmq_getsockopt");
    SYMBOL(zerrno, "zmq_errno");
    SYMBOL(msg_recv, "zmq_msg_recv"); /* last: its presence says the module is ready */
#undef SYMBOL
    Py_RETURN_NONE;
}

static int readable(void *zsock) {
    int events = 0;
    size_t size = sizeof events;
    if (getsockopt_(zsock, ZMQ_EVENTS, &events, &size) != 0)
        return 0;
    return events & ZMQ_POLLIN;
}

/* receive(sock, handle, limit) -> list of messages (lists of bytes), at most `limit`: every
   message waiting, EVENTS read again once the socket says Again (as the pure pump does). */
static PyObject *receive_messages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "receive(sock, handle, limit)");
        return NULL;
    }
    void *zsock = open_handle(args[0], args[1]);
    if (zsock == NULL)
        return NULL;
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    if (limit < 0 && PyErr_Occurred())
        return NULL;
    PyObject *batch = PyList_New(0);
    if (batch == NULL)
        return NULL;
    zmq_msg_t msg;
    while (PyList_GET_SIZE(batch) < limit && readable(zsock)) {
        Py_ssize_t taken = PyList_GET_SIZE(batch);
        while (PyList_GET_SIZE(batch) < limit) {
            msg_init(&msg);
            if (msg_recv(&msg, zsock, ZMQ_DONTWAIT) < 0) {
                int error = zerrno();
                msg_close(&msg);
                if (error == EAGAIN || error == EINTR)
                    break;
                Py_DECREF(batch);
                return raise_zmq(error);
            }
            PyObject *frames = PyList_New(0);
            if (frames == NULL) {
                msg_close(&msg);
                Py_DECREF(batch);
                return NULL;
            }
            for (;;) {
                /* The rest of a multipart message is there already: ZeroMQ delivers it whole. */
                PyObject *frame = PyBytes_FromStringAndSize((const char *)msg_data(&msg), (Py_ssize_t)msg_size(&msg));
                int more = msg_more(&msg);
                msg_close(&msg);
                if (frame == NULL || PyList_Append(frames, frame) < 0) {
                    Py_XDECREF(frame);
                    Py_DECREF(frames);
                    Py_DECREF(batch);
                    return NULL;
                }
                Py_DECREF(frame);
                if (!more)
                    break;
                msg_init(&msg);
                if (msg_recv(&msg, zsock, ZMQ_DONTWAIT) < 0) {
                    int error = zerrno();
                    msg_close(&msg);
                    Py_DECREF(frames);
                    Py_DECREF(batch);
                    return raise_zmq(error);
                }
            }
            int appended = PyList_Append(batch, frames);
            Py_DECREF(frames);
            if (appended < 0) {
                Py_DECREF(batch);
                return NULL;
            }
        }
        if (PyList_GET_SIZE(batch) == taken)
            break; /* EVENTS said POLLIN with nothing to take: no reason to spin */
    }
    return batch;
}

/* Frame `index` of a message sent with `flags`: 0 sent, -1 libzmq said no (zmq_errno), -2 a
   Python exception. Each frame is taken as the pure pump takes it, `frames[index]` when it is due. */
static int send_frame(void *zsock, PyObject *frames, Py_ssize_t index, int flags) {
    PyObject *frame = PySequence_GetItem(frames, index);
    if (frame == NULL)
        return -2;
    Py_buffer view;
    int got = PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE);
    Py_DECREF(frame);
    if (got < 0)
        return -2;
    int result = zsend(zsock, view.buf, (size_t)view.len, flags);
    PyBuffer_Release(&view);
    return result < 0 ? -1 : 0;
}

/* send(sock, handle, frames) -> 0 sent, 1 not taken (Again at its first frame: nothing left),
   2 unroutable (its peer gone: dropped, the rest of its frames sent so that libzmq's dropping
   ends with this message). */
static PyObject *send_message(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send(sock, handle, frames)");
        return NULL;
    }
    void *zsock = open_handle(args[0], args[1]);
    if (zsock == NULL)
        return NULL;
    PyObject *frames = args[2];
    Py_ssize_t count = PySequence_Size(frames);
    if (count < 0)
        return NULL;
    if (count == 0) {
        PyErr_SetString(PyExc_ValueError, "send: a message has at least one frame");
        return NULL;
    }
    Py_ssize_t last = count - 1;
    int result = send_frame(zsock, frames, 0, last > 0 ? ZMQ_DONTWAIT | ZMQ_SNDMORE : ZMQ_DONTWAIT);
    if (result == -2)
        return NULL;
    if (result == -1) {
        int error = zerrno();
        if (error == EAGAIN)
            return PyLong_FromLong(NOT_TAKEN);
        if (error == HOST_UNREACHABLE)
            return PyLong_FromLong(UNROUTABLE);
        return raise_zmq(error);
    }
    long outcome = SENT;
    for (Py_ssize_t index = 1; index <= last; index++) {
        result = send_frame(zsock, frames, index, index < last ? ZMQ_DONTWAIT | ZMQ_SNDMORE : ZMQ_DONTWAIT);
        if (result == -2) {
            /* A frame that is not a buffer (a caller's bug): end the message libzmq holds open with
               an empty frame, or the next message sent would complete this one. */
            zsend(zsock, "", 0, ZMQ_DONTWAIT);
            return NULL;
        }
        if (result == -1) {
            int error = zerrno();
            if (error != EAGAIN)
                return raise_zmq(error);
            /* The peer a DEALER chose went away mid-message: libzmq dropped it and drops frames up
               to the message's end, so send them, or it would drop the next message instead. */
            outcome = UNROUTABLE;
        }
    }
    return PyLong_FromLong(outcome);
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "load(path): take libzmq's functions from the copy pyzmq loaded."},
    {"receive", (PyCFunction)(void (*)(void))receive_messages, METH_FASTCALL,
     "receive(sock, handle, limit) -> every message waiting (at most limit), each a list of bytes."},
    {"send", (PyCFunction)(void (*)(void))send_message, METH_FASTCALL,
     "send(sock, handle, frames) -> 0 sent, 1 not taken, 2 unroutable."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "zmq_frames", NULL, -1, methods};

PyMODINIT_FUNC PyInit_zmq_frames(void) {
    PyObject *errors = PyImport_ImportModule("zmq.error");
    if (errors == NULL)
        return NULL;
    zmq_error = PyObject_GetAttrString(errors, "ZMQError");
    Py_DECREF(errors);
    if (zmq_error == NULL)
        return NULL;
    closed_name = PyUnicode_InternFromString("closed");
    if (closed_name == NULL)
        return NULL;
    return PyModule_Create(&module);
}
