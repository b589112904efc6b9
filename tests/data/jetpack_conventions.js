// circuit-tracer's viewer loads d3-jetpack from the build its authors host, whose
// d3.conventions() also returns c.drawAxis(sel); the npm package's d3-jetpack 2.2.0 draws axes
// with d3.drawAxis(c) instead. This adds the method, drawing with the npm package's function.
(function () {
  var conventions = d3.conventions
  d3.conventions = function (c) {
    c = conventions(c)
    c.drawAxis = function (sel) { return d3.drawAxis(Object.assign({}, c, {svg: sel || c.svg})) }
    return c
  }
})()
